"""Integrations of ODC with accelerate (`accelerate`), the transformers Trainer (`trainer`) and TRL (`trl`).

Import the submodule you need; each imports its library.
"""
