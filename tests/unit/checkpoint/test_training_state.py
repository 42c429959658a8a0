"""State dicts as training loops write them, in one process: OrderedDicts, optimizer state with
int keys, lists and tuples, Stateful objects, RNG states, DCP-converted checkpoints loaded
strictly, the dtype opt-in, float8, paths."""

from __future__ import annotations

import collections
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as ckpt
from shardwise.cli import main as cli_main


def _trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    data = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    for _ in range(steps):
        model(data).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
        sched.step()
    return model, optim, sched


def _assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for key, state in sa["state"].items():
        assert state.keys() == sb["state"][key].keys()
        for name, value in state.items():
            assert torch.equal(value, sb["state"][key][name]), (key, name)


def test_model_optimizer_scheduler_and_rng_round_trip(tmp_path: Path) -> None:
    model, optim, sched = _trained(0, 3)
    random.seed(5)
    torch.manual_seed(9)
    state = {
        "model": model.state_dict(),  # an OrderedDict
        "optim": optim.state_dict(),  # int keys, a list of param groups, tuples (betas)
        "sched": sched,  # a Stateful object
        "rng": torch.get_rng_state(),
        "py_rng": random.getstate(),  # (3, a tuple of 625 ints, None)
        "step": 3,
        "history": [0.5, 0.25],
    }
    ckpt.save(state, tmp_path / "c")

    fresh_model, fresh_optim, fresh_sched = _trained(1, 1)  # other values, state present
    target = {
        "model": fresh_model.state_dict(),
        "optim": fresh_optim.state_dict(),
        "sched": fresh_sched,
        "rng": torch.zeros_like(torch.get_rng_state()),
        "py_rng": None,
        "step": 0,
        "history": [],
    }
    model_dict = target["model"]
    result = ckpt.load(target, tmp_path / "c")
    assert result == ckpt.LoadResult([], [])
    # The same containers were filled; the model's dict stays an OrderedDict.
    assert target["model"] is model_dict and isinstance(model_dict, collections.OrderedDict)
    for name, value in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[name], value)
    fresh_optim.load_state_dict(target["optim"])
    _assert_same_optimizer(fresh_optim, optim)
    assert fresh_optim.param_groups[0]["lr"] == optim.param_groups[0]["lr"] == 0.0125
    assert isinstance(fresh_optim.param_groups[0]["betas"], tuple)
    # The Stateful scheduler got load_state_dict.
    assert fresh_sched.last_epoch == sched.last_epoch == 3
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
    assert torch.equal(target["rng"], state["rng"])
    assert isinstance(target["py_rng"], tuple) and target["py_rng"] == random.getstate()
    random.setstate(target["py_rng"])  # a tuple again: accepted
    assert target["step"] == 3 and target["history"] == [0.5, 0.25]

    # Training continues identically.
    data = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    for net, opt in ((model, optim), (fresh_model, fresh_optim)):
        net(data).pow(2).mean().backward()
        opt.step()
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_int_keys_and_their_digits_stay_distinct(tmp_path: Path) -> None:
    state = {"m": {0: torch.ones(2), "0": torch.zeros(2), 1: "int", "1": "str"}}
    ckpt.save(state, tmp_path / "c")
    target: dict[str, Any] = {"m": {0: torch.empty(2), "0": torch.empty(2), 1: None, "1": None}}
    assert ckpt.load(target, tmp_path / "c") == ckpt.LoadResult([], [])
    assert torch.equal(target["m"][0], torch.ones(2))
    assert torch.equal(target["m"]["0"], torch.zeros(2))
    assert target["m"][1] == "int" and target["m"]["1"] == "str"
    keys = set(ckpt.read_metadata(tmp_path / "c").state_dict_metadata)
    assert {"m.0", "m.1"} <= keys and len(keys) == 4


def test_lists_and_tuples_of_tensors_are_filled_in_place(tmp_path: Path) -> None:
    pair = (torch.arange(3.0), "label")
    state = {"pair": pair, "stack": [torch.ones(2), {"x": torch.full((1,), 7.0)}], "empty": ()}
    ckpt.save(state, tmp_path / "c")
    out_tensor = torch.empty(3)
    target: dict[str, Any] = {
        "pair": (out_tensor, None),
        "stack": [torch.empty(2), {"x": torch.empty(1)}],
        "empty": (),
    }
    ckpt.load(target, tmp_path / "c")
    assert isinstance(target["pair"], tuple) and target["pair"][1] == "label"
    assert target["pair"][0] is out_tensor and torch.equal(out_tensor, torch.arange(3.0))
    assert torch.equal(target["stack"][1]["x"], torch.full((1,), 7.0))
    assert target["empty"] == ()


def test_strict_false_reports_and_warns(tmp_path: Path) -> None:
    ckpt.save({"a": torch.ones(1), "b": 2}, tmp_path / "c")
    target: dict[str, Any] = {"a": torch.zeros(1), "c": 5}
    with pytest.raises(ckpt.CheckpointKeyError, match="missing from the checkpoint"):
        ckpt.load(target, tmp_path / "c")
    assert torch.equal(target["a"], torch.zeros(1))
    with pytest.warns(UserWarning, match=r"1 key missing from the checkpoint \('c'\)"):
        result = ckpt.load(target, tmp_path / "c", strict=False)
    assert result.missing_keys == ["c"] and result.unexpected_keys == ["b"]
    assert torch.equal(target["a"], torch.ones(1)) and target["c"] == 5


def test_a_converted_dcp_checkpoint_loads_strictly_into_model_and_optimizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    model, optim, _ = _trained(0, 3)  # its scheduler changed the learning rate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP's single-process notice
        dcp.save(
            {"model": model.state_dict(), "optim": optim.state_dict()},
            checkpoint_id=str(tmp_path / "dcp"),
            no_dist=True,
        )
    assert cli_main(["convert-dcp", str(tmp_path / "dcp"), str(tmp_path / "c")]) == 0
    capsys.readouterr()

    fresh_model, fresh_optim, _ = _trained(1, 1)
    target = {"model": fresh_model.state_dict(), "optim": fresh_optim.state_dict()}
    result = ckpt.load(target, tmp_path / "c")  # strict
    assert result == ckpt.LoadResult([], [])
    fresh_optim.load_state_dict(target["optim"])
    _assert_same_optimizer(fresh_optim, optim)
    assert fresh_optim.param_groups[0]["lr"] == 0.0125
    for name, value in model.state_dict().items():
        assert torch.equal(fresh_model.state_dict()[name], value)


@pytest.mark.parametrize(
    "dtype",
    [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz],
)
def test_float8_round_trips_exactly(tmp_path: Path, dtype: torch.dtype) -> None:
    raw = torch.randint(0, 256, (64, 33), dtype=torch.uint8, generator=torch.Generator())
    value = raw.view(dtype)
    ckpt.save({"w": value}, tmp_path / "c")
    target = {"w": torch.empty(64, 33, dtype=dtype)}
    ckpt.load(target, tmp_path / "c")
    assert torch.equal(target["w"].view(torch.uint8), raw)  # every bit, NaNs included
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "w").view(torch.uint8), raw)


@pytest.mark.parametrize(
    ("saved", "wanted"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float16),
        (torch.float32, torch.float8_e4m3fn),
        (torch.float8_e5m2, torch.float32),
    ],
)
def test_dtype_cast_is_an_opt_in(tmp_path: Path, saved: torch.dtype, wanted: torch.dtype) -> None:
    source = (torch.randn(8, 300, generator=torch.Generator().manual_seed(3)) * 4).to(saved)
    ckpt.save({"w": source}, tmp_path / "c")
    target = {"w": torch.full((8, 300), 1.0, dtype=wanted)}
    with pytest.raises(ckpt.CheckpointMismatchError, match="pass allow_dtype_cast=True"):
        ckpt.load(target, tmp_path / "c")
    assert torch.all(target["w"] == 1)
    ckpt.load(target, tmp_path / "c", allow_dtype_cast=True)
    assert torch.equal(target["w"], source.to(wanted))


def test_paths_may_be_path_like_or_start_with_a_tilde(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    ckpt.save({"w": torch.ones(2)}, "~/ckpt")
    assert (tmp_path / "ckpt" / "shardwise.json").is_file()
    assert not Path("~").exists()
    target = {"w": torch.zeros(2)}
    ckpt.load(target, "~/ckpt")
    assert torch.equal(target["w"], torch.ones(2))
    assert torch.equal(ckpt.load_tensor(tmp_path / "ckpt", "w"), torch.ones(2))
    assert "w" in ckpt.read_metadata("~/ckpt").state_dict_metadata


def test_dcp_keyword_checkpoint_id_is_not_accepted(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="checkpoint_id"):
        ckpt.save({"w": torch.ones(1)}, checkpoint_id=str(tmp_path))  # type: ignore[call-arg]


def test_values_that_need_pickle_get_the_right_hint(tmp_path: Path) -> None:
    import numpy as np

    with pytest.raises(TypeError, match=r"dtype <U1 have no exact JSON form.*torch\.from_numpy"):
        ckpt.save({"a": np.array(["x"])}, tmp_path / "c")
    with pytest.raises(TypeError, match=r"dtype object have no exact JSON form"):
        ckpt.save({"a": (1, np.array([None]))}, tmp_path / "c")
    with pytest.raises(TypeError, match="sorted list"):
        ckpt.save({"a": {1, 2}}, tmp_path / "c")

    class Custom:
        pass

    with pytest.raises(TypeError, match="allow_pickle=True"):
        ckpt.save({"a": Custom()}, tmp_path / "c")


def test_a_fresh_optimizer_gets_its_state_from_the_checkpoint(tmp_path: Path) -> None:
    # Resuming at start-up: the optimizer has not stepped, so its state dict's "state" is
    # empty; the checkpoint's entries under it are loaded into it (int keys as saved).
    model, optim, sched = _trained(0, 3)
    ckpt.save({"model": model, "optim": optim, "sched": sched}, tmp_path / "c")
    torch.manual_seed(1)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh_optim = torch.optim.AdamW(fresh_model.parameters(), lr=0.1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_optim, step_size=1, gamma=0.5)
    assert fresh_optim.state_dict()["state"] == {}
    target = {"model": fresh_model, "optim": fresh_optim, "sched": fresh_sched}
    assert ckpt.load(target, tmp_path / "c") == ckpt.LoadResult([], [])
    _assert_same_optimizer(fresh_optim, optim)
    assert fresh_sched.last_epoch == 3
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_growing_an_empty_mapping_refuses_entries_that_cannot_nest(tmp_path: Path) -> None:
    # "state.x" is a value and "state.x.a" lies under it: they cannot both go into an
    # empty "state"; the refusal comes before anything is copied.
    state = {"o": {"state.x": 1, "state.x.a": torch.ones(1), 0: 0}, "w": torch.ones(2)}
    ckpt.save(state, tmp_path / "c")
    target: dict[str, Any] = {"o": {"state": {}, 0: 0}, "w": torch.zeros(2)}
    with pytest.raises(ckpt.CheckpointFormatError, match="lies under another entry's value"):
        ckpt.load(target, tmp_path / "c")
    assert target["o"] == {"state": {}, 0: 0} and torch.equal(target["w"], torch.zeros(2))


def test_a_converted_dcp_checkpoint_into_a_fresh_optimizer_is_refused_not_misplaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # DCP turns the optimizer's int state keys into strings: growing a fresh optimizer's
    # empty state from them would give "0" keys that Optimizer.load_state_dict leaves unused.
    # The load says so, before anything is copied.
    import torch.distributed.checkpoint as dcp

    model, optim, _ = _trained(0, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"model": model.state_dict(), "optim": optim.state_dict()},
            checkpoint_id=str(tmp_path / "dcp"),
            no_dist=True,
        )
    assert cli_main(["convert-dcp", str(tmp_path / "dcp"), str(tmp_path / "c")]) == 0
    capsys.readouterr()
    torch.manual_seed(1)
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    before = {name: value.clone() for name, value in fresh.state_dict().items()}
    target = {"model": fresh.state_dict(), "optim": fresh_optim.state_dict()}
    with pytest.raises(ckpt.CheckpointMismatchError, match="step a fresh optimizer once"):
        ckpt.load(target, tmp_path / "c")
    assert target["optim"]["state"] == {}
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, before[name])


def test_load_tensor_takes_the_dotted_key_inspect_shows(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    ckpt.save({"optim": optimizer.state_dict()}, tmp_path / "c")
    expected = optimizer.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(ckpt.load_tensor(tmp_path / "c", "optim.state.0.exp_avg"), expected)
    # An exact key wins; two entries with one dotted key are refused, not guessed.
    ckpt.save({"a": {0: torch.ones(1), "0": torch.zeros(1)}}, tmp_path / "d")
    assert torch.equal(ckpt.load_tensor(tmp_path / "d", "a.0"), torch.zeros(1))
    ckpt.save({"c": {0: {"1": torch.ones(1)}, "0": {1: torch.zeros(1)}}}, tmp_path / "e")
    with pytest.raises(ckpt.CheckpointKeyError, match="2 tensors"):
        ckpt.load_tensor(tmp_path / "e", "c.0.1")


def test_a_fresh_optimizer_of_meta_parameters_grows_its_state_on_the_cpu(tmp_path: Path) -> None:
    # Its parameters have no memory to make the state like: the state is read whole, and the
    # optimizer's own load_state_dict moves it to the parameters' device, as torch does.
    _, optim, _ = _trained(0, 2)
    ckpt.save({"optim": optim}, tmp_path / "c")
    with torch.device("meta"):
        meta_model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
        )
    meta_optim = torch.optim.AdamW(meta_model.parameters(), lr=0.1)
    ckpt.load({"optim": meta_optim}, tmp_path / "c")
    state = meta_optim.state_dict()["state"]
    assert sorted(state) == sorted(optim.state_dict()["state"])
    assert all(entry["exp_avg"].is_meta for entry in state.values())
