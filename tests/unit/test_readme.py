"""The Python blocks of the README and of the guides in docs/ run as tests, so that neither
can drift from the code.

Every fenced block of README.md and of every page under docs/ is labelled (one of
:data:`LANGUAGES`) and starts at column 0; every ``python`` block sits under a (page, heading)
of :data:`RUN`, and the test named there runs it, or of :data:`FRAGMENTS`: outlines that are
not complete programs, each with the reason. The runnable blocks:

* *Checkpoints* (docs/checkpoints.md), the Hugging Face and torchtitan blocks and the README's
  one-process blocks in this process, with no process group, in a temporary working directory
  (the pages' paths are relative).
* *Sharded tensors*, *A training script* (``train.py``, docs/manager.md), *FSDP2 and DTensor*,
  the DCP blocks and the README's multi-rank blocks on the gloo ranks of the harness
  (``tests/harness.py``), as under ``torchrun``: their ``dist.init_process_group("gloo")``
  finds the harness's group already up, and ``dist.destroy_process_group()`` leaves it up for
  the next test.

A block runs as the page's own lines (tracebacks point into the page), with every warning an
error, and the test then checks that it did what the page says it does.
"""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

import shardwise.checkpoint as ckpt
from shardwise import cli
from tests.harness import distributed, run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: Every page whose blocks are checked: the README and the documentation site's pages.
PAGES = (README, *sorted(DOCS.rglob("*.md")))
#: Fence labels; only ``python`` blocks run (and the ``shardwise`` lines of some ``bash`` ones).
LANGUAGES = frozenset({"python", "bash", "text", "json"})


@dataclass(frozen=True, slots=True)
class Section:
    """The blocks of one page under one heading."""

    page: Path
    heading: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}, {self.heading!r}"


SHARDED_TENSORS = Section(DOCS / "sharded-tensors.md", "Sharded tensors")
CHECKPOINTS = Section(DOCS / "checkpoints.md", "Checkpoints")
OWN_CODE = Section(DOCS / "manager.md", "A training script: `train.py`")
FSDP2 = Section(DOCS / "checkpoints.md", "FSDP2 and DTensor")
FROM_DCP = Section(DOCS / "dcp.md", "An FSDP2 job")
FROM_TORCHTITAN = Section(DOCS / "torchtitan.md", "Switching a job to shardwise")
TRAINING = Section(DOCS / "sharded-tensors.md", "Training with sharded parameters")
COMMAND_LINE = Section(DOCS / "cli.md", "Examples")
EXPORT_HF = Section(DOCS / "huggingface.md", "Export to Hugging Face")
HF_IN_OUT = Section(DOCS / "huggingface.md", "Round trip in one process")
README_SHARDED = Section(README, "Sharded tensors")
README_CHECKPOINTS = Section(README, "Checkpoints")
README_MANAGER = Section(README, "A training run: `CheckpointManager`")
README_HF = Section(README, "Hugging Face")
README_TORCHTITAN = Section(README, "torchtitan")
README_DCP = Section(README, "Code that calls DCP")
#: Every section with Python blocks that run, and the test that runs them.
RUN = {
    SHARDED_TENSORS: "test_sharded_tensor_tour_on_4_ranks",
    CHECKPOINTS: "test_checkpoint_tour_in_one_process",
    OWN_CODE: "test_train_py_saves_and_resumes_on_2_ranks",
    FSDP2: "test_fsdp2_recipe_saves_on_2_ranks_and_resumes_on_4",
    FROM_DCP: "test_dcp_plugins_block_on_2_ranks",
    FROM_TORCHTITAN: "test_torchtitan_block_in_one_process",
    TRAINING: "test_training_tour_on_4_ranks",
    EXPORT_HF: "test_export_to_hugging_face_in_one_process",
    HF_IN_OUT: "test_hugging_face_in_and_out_in_one_process",
    README_SHARDED: "test_readme_sharded_tensors_on_4_ranks",
    README_CHECKPOINTS: "test_readme_checkpoints_in_one_process",
    README_MANAGER: "test_readme_manager_saves_and_resumes_in_one_process",
    README_HF: "test_readme_hugging_face_in_one_process",
    README_TORCHTITAN: "test_readme_torchtitan_in_one_process",
    README_DCP: "test_readme_dcp_on_2_ranks",
}
#: Sections whose Python blocks are outlines (names left open, ``...`` for the training), not
#: programs, and why; each has a runnable counterpart in :data:`RUN`.
FRAGMENTS = {
    Section(DOCS / "manager.md", "A series of checkpoints: `CheckpointManager`"): (
        "the options of a long run on S3; train.py under 'A training script' runs"
    ),
    Section(DOCS / "dcp.md", "DCP storage plugins: `shardwise.checkpoint.dcp`"): (
        "the two calls with state_dict and path left open; 'An FSDP2 job' runs"
    ),
    Section(DOCS / "huggingface.md", "Hugging Face weights in and out of a sharded job"): (
        "a multi-rank job loading a model from /models; 'Round trip in one process' runs"
    ),
}


@dataclass(frozen=True, slots=True)
class Block:
    """One ``python`` block of a page."""

    page: Path
    section: str
    """The heading the block stands under."""
    line: int
    """The page's line of the block's first line of code (1-based)."""
    code: str

    def compile(self) -> CodeType:
        # Blank lines in front, so that tracebacks name the page and its own line numbers.
        return compile("\n" * (self.line - 1) + self.code, str(self.page), "exec")


def page_blocks(page: Path) -> list[Block]:
    """The ``python`` blocks of ``page``, in order; asserts that every fence is well formed."""
    blocks: list[Block] = []
    name = page.relative_to(ROOT)
    section = ""
    language: str | None = None  # of the open fence
    start, lines = 0, []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        assert not (line.lstrip().startswith("```") and line[0] != "`"), (
            f"{name}:{number}: indented fence (its block would not run)"
        )
        if language is None and line.startswith("```"):
            language = line[3:].strip()
            assert language in LANGUAGES, (
                f"{name}:{number}: label the fence with one of {sorted(LANGUAGES)}, "
                f"not {language!r}"
            )
            start, lines = number + 1, []
        elif language is None:
            if line.startswith("#"):
                section = line.lstrip("#").strip()
        elif line.startswith("```"):
            assert line == "```", f"{name}:{number}: a closing fence has no label"
            if language == "python":
                blocks.append(Block(page, section, start, "\n".join(lines) + "\n"))
            language = None
        else:
            lines.append(line)
    assert language is None, f"{name} ends inside a fenced block"
    return blocks


def section_blocks(section: Section) -> list[Block]:
    blocks = [block for block in page_blocks(section.page) if block.section == section.heading]
    assert blocks, f"no Python block under {section}"
    return blocks


def run_blocks(blocks: Iterable[Block]) -> dict[str, Any]:
    """Run ``blocks`` one after the other in one fresh namespace, as a script; return it."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a warning the page's code gets is a page bug
        for block in blocks:
            exec(block.compile(), namespace)
    return namespace


@contextlib.contextmanager
def launched_by_harness() -> Iterator[None]:
    """In a harness worker, the default group a page's script creates is already up (the
    harness did what torchrun and ``init_process_group`` do), and must outlive the script."""
    assert dist.is_initialized()

    def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
        assert backend == "gloo" and not kwargs, "the pages' scripts must run on CPU with gloo"

    def destroy_process_group(group: Any = None) -> None:
        assert group is None, "the pages' scripts destroy only the default group"

    with (
        mock.patch.object(dist, "init_process_group", init_process_group),
        mock.patch.object(dist, "destroy_process_group", destroy_process_group),
    ):
        yield


def run_script(blocks: Iterable[Block], cwd: str) -> dict[str, Any]:
    """Run ``blocks`` as a script on this rank, in ``cwd`` (the harness restores the working
    directory after the body)."""
    os.chdir(cwd)
    with launched_by_harness():
        return run_blocks(blocks)


def test_every_block_is_labelled_and_every_python_block_runs() -> None:
    sections = {Section(block.page, block.section) for page in PAGES for block in page_blocks(page)}
    assert sections == set(RUN) | set(FRAGMENTS), (
        "every Python block of README.md and docs/ must stand under a heading that a test of "
        "this module runs (see RUN) or that FRAGMENTS names; found Python blocks under "
        f"{sorted(map(str, sections))}"
    )
    assert not set(RUN) & set(FRAGMENTS)
    assert all(name in globals() for name in RUN.values())


# -- API tour: sharded tensors -----------------------------------------------------------------


@distributed(world_size=4)
def test_sharded_tensor_tour_on_4_ranks() -> None:
    namespace = run_script(section_blocks(SHARDED_TENSORS), os.getcwd())
    sizes = [shard.shard_sizes for shard in namespace["md"].shards_metadata]
    assert sizes == [[3, 4], [3, 4], [3, 4], [1, 4]]
    assert namespace["st"].size() == torch.Size([10, 4])
    if dist.get_rank() == 0:
        assert torch.equal(namespace["full"], namespace["data"]), "gather != rank 0's data"
    else:
        assert namespace["full"] is None


# -- API tour: checkpoints ---------------------------------------------------------------------


@pytest.fixture
def rng_states() -> Iterator[None]:
    """Restore this process's RNG states after a block that sets them."""
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    yield
    torch.set_rng_state(torch_state)
    random.setstate(python_state)


@pytest.mark.usefixtures("rng_states")
def test_checkpoint_tour_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(section_blocks(CHECKPOINTS))

    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == [
        "step-1000",
        "step-1001",
    ]
    assert namespace["result"] == ckpt.LoadResult(missing_keys=[], unexpected_keys=[])
    state, model = namespace["state"], namespace["model"]
    assert state["step"] == 1000
    assert state["sched"] is namespace["scheduler"], "a Stateful value is loaded into"
    assert isinstance(state["rng"], tuple) and isinstance(state["rng"][1], tuple)
    assert 0 in state["optim"]["state"], "the optimizer's int keys stay ints"

    partial = namespace["partial"]
    assert partial.missing_keys == []
    assert {"optim.state.0.exp_avg", "sched.last_epoch", "step"} <= set(partial.unexpected_keys)
    assert not any(key.startswith("model.") for key in partial.unexpected_keys)
    bf16 = namespace["bf16_model"]
    assert bf16.weight.dtype == torch.bfloat16
    assert torch.equal(bf16.weight, model.weight.detach().to(torch.bfloat16))

    assert "model.weight" in namespace["meta"].state_dict_metadata
    assert torch.equal(namespace["w"], model.weight.detach())
    # The asynchronous save wrote the same state.
    again = {"model": torch.nn.Linear(4, 8)}
    ckpt.load(again, tmp_path / "checkpoints" / "step-1001")
    assert torch.equal(again["model"].weight, model.weight)


# -- A training script: train.py (docs/manager.md) ------------------------------------------


def _train_py(cwd: str) -> dict[str, Any]:
    namespace = run_script(section_blocks(OWN_CODE), cwd)
    return {
        "start": namespace["start"],
        "lr": namespace["scheduler"].get_last_lr(),
        "params": {name: p.detach().clone() for name, p in namespace["net"].named_parameters()},
    }


@pytest.mark.distributed(world_size=2, fresh=False, rpc=False)
def test_train_py_saves_and_resumes_on_2_ranks(tmp_path: Path) -> None:
    uninterrupted = run_on_ranks(_train_py, 2, args=(str(tmp_path),))
    assert [result["start"] for result in uninterrupted] == [0, 0]
    checkpoints = tmp_path / "checkpoints"
    # Saved every 5 steps, the last 3 kept.
    assert sorted(path.name for path in checkpoints.iterdir()) == [
        f"step-{step:08d}" for step in (10, 15, 20)
    ]

    # As if the run had died while saving step 15: step 20 never happened and step 15 was
    # never committed (no index), so the script resumes from step 10.
    shutil.rmtree(checkpoints / "step-00000020")
    (checkpoints / "step-00000015" / "shardwise.json").unlink()
    resumed = run_on_ranks(_train_py, 2, args=(str(tmp_path),))

    assert [result["start"] for result in resumed] == [10, 10]
    for rank, (got, expected) in enumerate(zip(resumed, uninterrupted, strict=True)):
        assert got["lr"] == expected["lr"], f"rank {rank}: the LR schedule did not resume"
        assert got["params"].keys() == expected["params"].keys()
        for name, tensor in expected["params"].items():
            assert torch.equal(got["params"][name], tensor), f"rank {rank}: {name} differs"


# -- FSDP2 and DTensor -------------------------------------------------------------------------


def _fsdp_blocks() -> tuple[Block, Block, Block]:
    blocks = section_blocks(FSDP2)
    assert len(blocks) == 3, f"expected set-up, save and resume blocks, got {len(blocks)}"
    return blocks[0], blocks[1], blocks[2]


def _fsdp_state(namespace: dict[str, Any]) -> dict[str, Any]:
    """The run's step, and its parameters and optimizer state as full tensors (collective)."""
    model, optim = namespace["model"], namespace["optim"]

    def full(value: Any) -> Any:
        return value.full_tensor() if isinstance(value, DTensor) else value

    assert all(isinstance(p, DTensor) for p in model.parameters()), "not sharded by FSDP2"
    _, optim_sd = get_state_dict(model, optim)
    return {
        "step": namespace["step"],
        "params": {name: full(p).detach() for name, p in model.named_parameters()},
        "optim": {
            f"{name}.{key}": full(value)
            for name, entry in optim_sd["state"].items()
            for key, value in entry.items()
        },
        "lr": optim.param_groups[0]["lr"],
    }


def _fsdp_save(cwd: str) -> dict[str, Any]:
    setup, save, _ = _fsdp_blocks()
    return _fsdp_state(run_script([setup, save], cwd))


def _fsdp_resume(cwd: str) -> dict[str, Any]:
    setup, _, resume = _fsdp_blocks()
    return _fsdp_state(run_script([setup, resume], cwd))


@pytest.mark.distributed(world_size=4, fresh=False, rpc=False)
def test_fsdp2_recipe_saves_on_2_ranks_and_resumes_on_4(tmp_path: Path) -> None:
    saved = run_on_ranks(_fsdp_save, 2, args=(str(tmp_path),))
    expected = saved[0]
    assert expected["step"] == 1 and expected["optim"], "the save block trains one step"
    for rank, got in enumerate(run_on_ranks(_fsdp_resume, 4, args=(str(tmp_path),))):
        assert got["step"] == 1, f"rank {rank}: step not loaded"
        assert got["lr"] == expected["lr"]
        for what in ("params", "optim"):
            assert got[what].keys() == expected[what].keys(), f"rank {rank}: {what} keys"
            for key, tensor in expected[what].items():
                assert torch.equal(got[what][key], tensor), f"rank {rank}: {key} differs"


# -- From code that calls DCP ------------------------------------------------------------------


def _dcp_block(cwd: str) -> dict[str, torch.Tensor]:
    namespace = run_script(section_blocks(FROM_DCP), cwd)
    weight = namespace["model"].weight
    return {
        "weight": weight.full_tensor().detach(),
        "saved": namespace["state"]["model"]["weight"].full_tensor(),
    }


def test_dcp_plugins_block_on_2_ranks(tmp_path: Path) -> None:
    results = run_on_ranks(_dcp_block, 2, args=(str(tmp_path),))
    path = tmp_path / "checkpoints" / "dcp"
    assert sorted(entry.name for entry in path.iterdir()) == ["data", "shardwise.json"]
    assert cli.main(["verify", str(path)]) == 0
    weight = ckpt.load_tensor(path, "model.weight")
    for result in results:
        assert torch.equal(result["weight"], weight) and torch.equal(result["saved"], weight)


# -- From torchtitan -------------------------------------------------------------------------


def test_torchtitan_block_in_one_process() -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.components.checkpointer import BaseCheckpointManager

    from shardwise.integrations.torchtitan import ShardwiseCheckpointManager

    checkpoint = run_blocks(section_blocks(FROM_TORCHTITAN))["checkpoint"]
    # What Trainer.Config.checkpoint takes, and what the trainer's build() makes of it.
    assert isinstance(checkpoint, BaseCheckpointManager.Config)
    assert checkpoint._owner is ShardwiseCheckpointManager
    assert (checkpoint.enable, checkpoint.interval, checkpoint.keep_latest_k) == (True, 500, 3)
    assert checkpoint.keep_every == 10_000
    assert checkpoint.preemption_signals == ["SIGTERM", "SIGUSR1"]
    assert checkpoint.async_save is True


# -- Training with sharded parameters ----------------------------------------------------------


def _training_tour(cwd: str) -> dict[str, Any]:
    namespace = run_script(section_blocks(TRAINING), cwd)
    state = namespace["optim"].state_dict()
    return {
        "step": namespace["step"],
        "grad type": type(namespace["model"][0].weight.grad).__name__,
        "sharded state": type(state["state"]["0.weight"]["exp_avg"]).__name__,
        "bias": namespace["model"][1].bias.detach().clone(),
    }


@pytest.mark.distributed(world_size=4, fresh=False, rpc=False)
def test_training_tour_on_4_ranks(tmp_path: Path) -> None:
    results = run_on_ranks(_training_tour, 4, args=(str(tmp_path),))
    assert (tmp_path / "checkpoints" / "sharded" / "shardwise.json").exists()
    for result in results:
        assert result["step"] == 10
        assert result["grad type"] == "ShardedTensor"  # what the block prints
        assert result["sharded state"] == "ShardedTensor"
        # sync_replicated_grads kept the replicated Linear identical on every rank.
        assert torch.equal(result["bias"], results[0]["bias"])


# -- Command line and Export to Hugging Face ---------------------------------------------------


def shardwise_commands(section: Section) -> list[str]:
    """The ``shardwise ...`` command lines of the ``bash`` blocks under ``section``
    (backslash continuations joined)."""
    commands: list[str] = []
    current, language, pending = "", None, ""
    for line in section.page.read_text(encoding="utf-8").splitlines():
        if language is None and line.startswith("```"):
            language = line[3:].strip()
        elif language is None:
            if line.startswith("#"):
                current = line.lstrip("#").strip()
        elif line.startswith("```"):
            language = None
        elif language == "bash" and current == section.heading:
            pending += line.rstrip("\\").strip() + " "
            if not line.endswith("\\"):
                if pending.startswith("shardwise "):
                    commands.append(pending.strip())
                pending = ""
    assert commands, f"no shardwise command under {section}"
    return commands


def _run_command(command: str) -> int:
    """``command`` (a line of a page, comment included) run as the shell would run it."""
    argv = shlex.split(command, comments=True)
    assert argv[0] == "shardwise", command
    return cli.main(argv[1:])


@pytest.mark.usefixtures("rng_states")
def test_command_line_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    monkeypatch.chdir(tmp_path)
    run_blocks(section_blocks(CHECKPOINTS))  # makes checkpoints/step-1000 and step-1001
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming a single process"
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id="dcp_checkpoint", no_dist=True)
    local, remote = [], []
    for command in shardwise_commands(COMMAND_LINE):
        (remote if "s3://" in command else local).append(command)
    commands = {"inspect", "verify", "diff", "consolidate", "convert-dcp", "ls", "materialize"}
    assert {shlex.split(c)[1] for c in local} == commands, "an example of every command"
    for command in local:
        assert _run_command(command) == 0, command
    assert (tmp_path / "hf_out" / "model.safetensors").is_file()
    assert (tmp_path / "converted" / "shardwise.json").is_file()
    assert (tmp_path / "alone" / "shardwise.json").is_file()
    # The s3:// examples need a bucket; their arguments at least parse.
    for command in remote:
        args = cli._app._parser().parse_args(shlex.split(command)[1:])
        assert isinstance(args.storage_options, dict), command


@pytest.mark.usefixtures("rng_states")
def test_export_to_hugging_face_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    train, load = section_blocks(EXPORT_HF)
    (command,) = shardwise_commands(EXPORT_HF)
    namespace = run_blocks([train])
    assert _run_command(command) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec(load.compile(), namespace)
    assert capsys.readouterr().out.splitlines()[-1] == "True"
    assert sorted(path.name for path in (tmp_path / "hf_out").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    model, hf_model = namespace["model"], namespace["hf_model"]
    loaded = hf_model.state_dict()
    assert sorted(loaded) == sorted(model.state_dict())
    for key, value in model.state_dict().items():
        assert loaded[key].dtype == torch.bfloat16, key
        assert torch.equal(loaded[key], value.to(torch.bfloat16)), key


def test_hugging_face_in_and_out_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(section_blocks(HF_IN_OUT))
    assert capsys.readouterr().out.splitlines()[-1] == (
        "LoadResult(missing_keys=[], unexpected_keys=[])"
    )
    names = sorted(path.name for path in (tmp_path / "hf_direct").iterdir())
    assert "config.json" in names and "model.safetensors.index.json" in names
    assert len([name for name in names if name.startswith("model-")]) > 1
    model, fresh = namespace["model"], namespace["fresh"]
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


# -- The README's own examples -----------------------------------------------------------------


@distributed(world_size=4)
def test_readme_sharded_tensors_on_4_ranks() -> None:
    namespace = run_script(section_blocks(README_SHARDED), os.getcwd())
    rows = [shard.tensor.size(0) for shard in namespace["st"].local_shards()]
    assert rows == [[3], [3], [3], [1]][dist.get_rank()], "the comment's 3, 3, 3, 1 rows"
    if dist.get_rank() == 0:
        assert torch.equal(namespace["full"], torch.arange(40.0).reshape(10, 4))
    else:
        assert namespace["full"] is None


def test_readme_checkpoints_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(section_blocks(README_CHECKPOINTS))
    assert namespace["result"] == ckpt.LoadResult(missing_keys=[], unexpected_keys=[])
    assert namespace["state"]["step"] == 1000
    path = tmp_path / "checkpoints" / "step-1000"
    weight = namespace["model"].weight.detach()
    assert torch.equal(ckpt.load_tensor(path, "model.weight"), weight)


def test_readme_manager_saves_and_resumes_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    first = run_blocks(section_blocks(README_MANAGER))
    assert first["start"] == 0
    # Saved every 5 steps, the last 2 kept.
    root = tmp_path / "runs" / "demo"
    assert sorted(path.name for path in root.iterdir()) == ["step-00000015", "step-00000020"]
    # Run again: it resumes at step 20, with the trained weights, and trains no further.
    again = run_blocks(section_blocks(README_MANAGER))
    assert again["start"] == 20
    for name, tensor in first["model"].named_parameters():
        assert torch.equal(dict(again["model"].named_parameters())[name], tensor), name


def test_readme_hugging_face_in_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace = run_blocks(section_blocks(README_HF))
    assert capsys.readouterr().out.splitlines()[-1] == (
        "LoadResult(missing_keys=[], unexpected_keys=[])"
    )
    names = sorted(path.name for path in (tmp_path / "hf_model").iterdir())
    assert names == ["config.json", "model.safetensors"]
    model = namespace["model"]
    fresh = type(model)(namespace["config"])
    ckpt.load_safetensors(fresh.state_dict(), tmp_path / "hf_model")
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_readme_torchtitan_in_one_process() -> None:
    pytest.importorskip("torchtitan")
    from torchtitan.components.checkpointer import BaseCheckpointManager

    from shardwise.integrations.torchtitan import ShardwiseCheckpointManager

    checkpoint = run_blocks(section_blocks(README_TORCHTITAN))["checkpoint"]
    assert isinstance(checkpoint, BaseCheckpointManager.Config)
    assert checkpoint._owner is ShardwiseCheckpointManager
    assert (checkpoint.enable, checkpoint.interval, checkpoint.keep_latest_k) == (True, 500, 3)


def _readme_dcp(cwd: str) -> torch.Tensor:
    namespace = run_script(section_blocks(README_DCP), cwd)
    return namespace["model"].weight.detach().clone()


def test_readme_dcp_on_2_ranks(tmp_path: Path) -> None:
    weights = run_on_ranks(_readme_dcp, 2, args=(str(tmp_path),))
    path = tmp_path / "checkpoints" / "dcp"
    assert cli.main(["verify", str(path)]) == 0
    saved = ckpt.load_tensor(path, "model.weight")
    for rank, weight in enumerate(weights):
        assert torch.equal(weight, saved), f"rank {rank}: not the saved weight"
