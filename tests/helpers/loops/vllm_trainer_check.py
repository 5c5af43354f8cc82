"""Checks of an ODC GRPO trainer that generates with vLLM (``--use_vllm true --vllm_mode colocate``), added from
outside by `tests/helpers/loops/run_example.py` with ``ODC_TEST_VLLM_CHECK=1``; the results go to
``<output_dir>/vllm_check_rank<r>.json``.

On the trainer's `VLLMGeneration` instance (whose ``sync_weights`` is ODC's per-rank sync):

* every weight sync and every vLLM ``generate`` call runs inside the torch.distributed call counter
  (`tests.helpers.infra.dist_counter`): ``sync_dist_calls`` / ``generation_dist_calls``, one entry per call;
* after every sync, outside the counter, the engine is compared with a Hugging Face model holding the trained weights
  gathered with DTensor's own collectives (with PEFT, the adapters merged into them by PEFT's ``merge_and_unload`` in
  this process) (every rank syncs once per step, at the same point): the log-probability of every token of
  `CHECK_PROMPTS` prompts (``logprob_max_diff``, to be within `LOGPROB_TOLERANCE`: a wrong tensor anywhere in the
  engine shows there, where a few greedy tokens may not), and greedy decoding of them: ``checks``, one entry per sync
  with the engine's tokens before the sync (those of the previous check: the weights do not change in between) and
  after it, and HF's;
* every ``generate`` call's prompts, completions and vLLM log-probs are recorded (``rollouts``), so that a one-process
  run can train on exactly these completions (`tests/helpers/loops/grpo_vllm_replay.py`);
* the engine's shutdown at the end of the run is recorded (``shutdown``: whether the job's process group was still
  there after it).

`float32_eager_engines` (called by run_example.py before the script runs) makes TRL's engines compute in float32, so
that the comparison is exact, and run eagerly.

vLLM is imported inside the functions only.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

CHECK_TOKENS = 8  # greedy tokens compared after each sync
#: Largest difference, in nats, between vLLM's prompt log-probabilities and the gathered model's, at any position of the
#: check prompts, for fp32 engines holding the same weights (measured: 1e-6 to 2e-6 on the tiny models; a wrong tensor
#: anywhere in the engine shows as 0.07 to 6 nats).
LOGPROB_TOLERANCE = 1e-4
CHECK_PROMPTS = 3
CHECK_PROMPT_WORDS = 24


def _check_prompts(tokenizer: Any) -> list[list[int]]:
    from odc_accelerate.demo import offline_texts

    texts = [" ".join(t.split()[:CHECK_PROMPT_WORDS]) for t in offline_texts()[:CHECK_PROMPTS]]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def vllm_prompt_logprobs(llm: Any, prompts: list[list[int]]) -> list[list[float]]:
    """vLLM's log-probability of every prompt token after the first, given the tokens before it (its raw logits)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        [o.prompt_logprobs[t][p[t]].logprob for t in range(1, len(p))] for o, p in zip(outputs, prompts, strict=True)
    ]


@torch.no_grad()
def hf_prompt_logprobs(model: Any, prompts: list[list[int]]) -> list[list[float]]:
    """The same log-probabilities from a Hugging Face model (float32)."""
    out = []
    for prompt in prompts:
        logits = model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append([float(logprobs[t - 1, prompt[t]]) for t in range(1, len(prompt))])
    return out


def max_logprob_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest difference over every position of every prompt (both must cover the same positions)."""
    assert [len(x) for x in a] == [len(y) for y in b], "log-probabilities of different prompt lengths"
    return max(abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def server_prompt_logprobs(client: Any, prompts: list[list[int]]) -> list[list[float]]:
    """`vllm_prompt_logprobs` from a vLLM server, through TRL's client (``/v1/completions`` with ``prompt_logprobs``)."""
    payload = {"model": client.model, "prompt": prompts, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    choices = client.session.post(f"{client.base_url}/v1/completions", json=payload).json()["choices"]
    return [
        [c["prompt_logprobs"][t][str(p[t])]["logprob"] for t in range(1, len(p))]
        for c, p in zip(choices, prompts, strict=True)
    ]


def _server_greedy(client: Any, prompts: list[list[int]]) -> list[list[int]]:
    out = client.generate(
        prompts, temperature=0.0, max_tokens=CHECK_TOKENS, logprobs=None, generation_kwargs={"ignore_eos": True}
    )
    return [list(c) for c in out["completion_ids"]]


def _vllm_greedy(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.no_grad()
def _hf_greedy(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for _ in range(CHECK_TOKENS):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1]
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def _load_all(model: Any, full: dict[str, torch.Tensor]) -> None:
    """Load every parameter; a tied LM head, which ``named_parameters`` lists once (as the embedding), comes with it."""
    missing, unexpected = model.load_state_dict(full, strict=False)
    tied = {name for name in missing if name.endswith("lm_head.weight")} if model.config.tie_word_embeddings else set()
    assert not unexpected and set(missing) == tied, (missing, unexpected)


class VLLMTrainerCheck:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.sync_dist_calls: list[dict[str, int]] = []
        self.generation_dist_calls: list[dict[str, int]] = []
        self.checks: list[dict[str, Any]] = []
        self.rollouts: list[dict[str, Any]] = []
        self.shutdown: dict[str, Any] = {}
        self._reference: Any = None
        self._prompts = _check_prompts(trainer.processing_class)

    def _gathered_model(self) -> Any:
        """A Hugging Face model holding the trained weights, gathered with DTensor's collectives (every rank)."""
        from transformers import AutoModelForCausalLM

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        full = {}
        for name, p in model.named_parameters():
            full[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().to(torch.float32).cpu()
        if hasattr(model, "peft_config"):
            # PEFT: the trained adapters merged into a fresh copy of the base model by PEFT itself, in one process
            from peft import get_peft_model

            base = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32, attn_implementation="sdpa")
            reference = get_peft_model(base, model.peft_config["default"])
            _load_all(reference, full)
            return reference.merge_and_unload().eval()
        if self._reference is None:
            self._reference = AutoModelForCausalLM.from_config(
                model.config, dtype=torch.float32, attn_implementation="sdpa"
            ).eval()
        _load_all(self._reference, full)
        return self._reference

    def _engine(self) -> tuple[Any, Any, Any] | None:
        """This rank's engine as (engine, greedy, prompt log-probs), or None: in server mode only the main process
        holds TRL's client of the one server."""
        generation = self.trainer.vllm_generation
        if generation.mode == "server":
            client = getattr(generation, "vllm_client", None)
            return None if client is None else (client, _server_greedy, server_prompt_logprobs)
        return generation.llm, _vllm_greedy, vllm_prompt_logprobs

    def sync(self, original: Any, count: Any) -> None:
        engine = self._engine()
        if engine is None:  # a rank without the server's client: its sync, counted, and its part of the gather
            with count() as calls:
                original()
            self.sync_dist_calls.append(dict(calls))
            self._gathered_model()
            return
        llm, greedy, prompt_logprobs = engine
        # Between two syncs the engine's weights do not change: the previous check's tokens are its tokens before.
        before = self.checks[-1]["vllm"] if self.checks else greedy(llm, self._prompts)
        stale = prompt_logprobs(llm, self._prompts)
        with count() as calls:
            original()
        self.sync_dist_calls.append(dict(calls))
        after = greedy(llm, self._prompts)
        reference = self._gathered_model()
        hf = _hf_greedy(reference, self._prompts)
        trained = hf_prompt_logprobs(reference, self._prompts)
        logprobs = max_logprob_difference(prompt_logprobs(llm, self._prompts), trained)
        self.checks.append(
            {
                "step": int(self.trainer.state.global_step),
                "before": before,
                "vllm": after,
                "hf": hf,
                "logprob_max_diff": logprobs,
                # the engine before this sync against the weights it syncs: what the check sees of a stale engine
                "stale_logprob_max_diff": max_logprob_difference(stale, trained),
                "positions": sum(len(p) - 1 for p in self._prompts),
            }
        )

    def generate(self, original: Any, count: Any, *args: Any, **kwargs: Any) -> Any:
        with count() as calls:
            result = original(*args, **kwargs)
        self.generation_dist_calls.append(dict(calls))
        prompt_ids, completion_ids, logprobs, _ = result
        self.rollouts.append(
            {
                "step": int(self.trainer.state.global_step),
                "prompt_ids": [list(map(int, p)) for p in prompt_ids],
                "completion_ids": [list(map(int, c)) for c in completion_ids],
                "logprobs": logprobs,
            }
        )
        return result

    def write(self) -> None:
        trainer = self.trainer
        out = trainer.args.output_dir
        os.makedirs(out, exist_ok=True)
        syncs = [vars(s) for s in getattr(trainer, "odc_vllm_syncs", [])]
        report = {
            "rank": trainer.accelerator.process_index,
            "pid": os.getpid(),  # names this rank's ODC files in /dev/shm
            "sync_dist_calls": self.sync_dist_calls,
            "generation_dist_calls": self.generation_dist_calls,
            "checks": self.checks,
            "syncs": syncs,
            "rollouts": self.rollouts,
            "shutdown": self.shutdown,
        }
        with open(os.path.join(out, f"vllm_check_rank{report['rank']}.json"), "w") as f:
            json.dump(report, f)


def instrument(trainer: Any) -> None:
    """Add the checks to ``trainer`` (an `ODCGRPOTrainer` with ``use_vllm=True``); written when the run ends."""
    import torch.distributed as dist

    from tests.helpers.infra.dist_counter import count_dist_calls

    check = VLLMTrainerCheck(trainer)
    generation = trainer.vllm_generation
    sync, generate = generation.sync_weights, generation.generate
    generation.sync_weights = lambda: check.sync(sync, count_dist_calls)
    generation.generate = lambda *a, **k: check.generate(generate, count_dist_calls, *a, **k)

    if generation.mode == "server":
        # no engine in this process: the report is written when training ends
        from transformers import TrainerCallback

        class WriteAtTrainEnd(TrainerCallback):
            def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                check.write()

        trainer.add_callback(WriteAtTrainEnd())
        trainer.odc_vllm_check = check
        return

    shutdown = trainer._odc_shutdown_vllm  # what end_training calls first (registered at __init__)

    def recorded_shutdown() -> None:
        shutdown()
        client = trainer.vllm_generation.llm.llm_engine.engine_core  # vLLM's InprocClient
        check.shutdown = {
            "called": True,
            "process_group_kept": dist.is_initialized(),
            # InprocClient.shutdown detaches its finalizer once the engine core is shut down
            "engine_core_shut_down": not client._finalizer.alive,
        }
        check.write()

    # The trainer registered its bound method; replace the registered entry with the recording one.
    from odc_accelerate.integrations import accelerate as odc_accelerate_integration

    hooks = odc_accelerate_integration._BEFORE_END.get(trainer.accelerator, [])
    for i, fn in enumerate(hooks):
        if getattr(fn, "__func__", None) is type(trainer)._odc_shutdown_vllm:
            hooks[i] = recorded_shutdown
    trainer.odc_vllm_check = check


def float32_eager_engines() -> None:
    """Make the vLLM engines TRL creates from now on in this process compute in float32 and run eagerly
    (``LLM(dtype="float32", enforce_eager=True)``). vLLM's ``dtype="auto"``, which TRL leaves, downcasts a float32
    checkpoint to bfloat16 / float16, and the check compares the engine with the float32 model exactly; eager mode
    saves the CPU backend's inductor compilation at start-up (about 20 s on 2 cores). Everything else is TRL's own
    ``LLM(...)`` call."""
    import functools

    from trl.generation import vllm_generation

    original = vllm_generation.LLM

    @functools.wraps(original)
    def llm(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("enforce_eager", True)
        return original(*args, **kwargs)

    vllm_generation.LLM = llm


def instrument_at_train_begin(trainer: Any) -> Any:
    """A callback that calls `instrument` on ``trainer`` when its training begins (its vLLM hooks are in place)."""
    from transformers import TrainerCallback

    class VLLMCheckCallback(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not hasattr(trainer, "odc_vllm_check"):
                instrument(trainer)

    return VLLMCheckCallback()
