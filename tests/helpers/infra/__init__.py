"""The harness around the tests' processes: the warm-start server (``warm_start.py`` and its client hook
``warm_start_site/``), network namespaces as hosts (``netns.py``), ``torch.distributed`` call counting
(``dist_counter.py``) and the install tests' environment (``install_env.py``)."""
