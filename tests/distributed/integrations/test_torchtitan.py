"""ShardwiseCheckpointManager driven as torchtitan 0.3.0's trainer drives it, on FSDP2 ranks.

torchtitan's own ModelWrapper, OptimizersContainer and LRSchedulersContainer around its llama3
debug model (shrunk: 2 layers, dim 32, vocab 64). The model's flex attention has no backward
on the CPU, so a step sets deterministic gradients (an elementwise function of the parameter
and the step: the same on any sharding) and runs the real optimizer and scheduler step.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import pytest

pytest.importorskip("torchtitan")

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer import CheckpointManager as DCPManager
from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
from torchtitan.models import llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

from shardwise.checkpoint import RestoreFallbackWarning
from shardwise.integrations.torchtitan import HF_SUFFIX, ShardwiseCheckpointManager
from tests.harness import run_on_ranks

DIM, VOCAB, HEADS, LAYERS, HIDDEN = 32, 64, 4, 2, 64
TOTAL = 6


def model_config() -> Any:
    """torchtitan's llama3 debug model, as its registry builds it, in miniature."""
    return llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
        ),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True,
            n_layers=LAYERS,
            dim=DIM,
            n_heads=HEADS,
            hidden_dim=HIDDEN,
            rope=ComplexRoPE.Config(
                dim=DIM // HEADS, max_seq_len=64, theta=500000, scaling="llama"
            ),
            attn_backend="flex",
        ),
    )


class TrainState:
    """The trainer's own entry (``train_state``): the step, as torchtitan's Trainer saves it."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]


class Job:
    """One trainer's objects: the model (FSDP2 over every rank), optimizers, schedulers and
    the checkpoint manager built from its config as the trainer builds it."""

    def __init__(self, checkpoint: Any, dump_folder: str, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.config = model_config()
        self.model = self.config.build()
        self.model.init_weights()
        for layer in self.model.layers.values():
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizers = default_adamw(lr=1e-2, implementation="for-loop").build(
            model_parts=[self.model]
        )
        self.lr_schedulers = LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear"
        ).build(optimizers=self.optimizers, training_steps=TOTAL)
        self.train_state = TrainState()
        self.checkpointer = checkpoint.build(
            dataloader=None,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            sd_adapter=llama3.Llama3StateDictAdapter(self.config, None),
            base_folder=dump_folder,
        )

    def train(self, until: int, load: bool = True) -> None:
        """torchtitan's Trainer.train: load, then per step forward/backward, wait for the
        staging, optimizer and scheduler steps, save."""
        if load:
            self.checkpointer.load(step=-1)
        while self.train_state.step < until:
            self.train_state.step += 1
            step = self.train_state.step
            self.optimizers.zero_grad()
            for index, param in enumerate(self.model.parameters()):
                local = param.to_local()
                grad = torch.sin(local * 3.0 + step + index) * 0.1
                param.grad = DTensor.from_local(grad, param.device_mesh, param.placements)
            # backward's reduce-scatter: a collective of the training thread on the default
            # group while the previous save's staging runs on the manager's thread
            dist.all_reduce(torch.ones(4))
            self.checkpointer.maybe_wait_for_staging()
            self.optimizers.step()
            self.lr_schedulers.step()
            self.checkpointer.save(step, last_step=step == TOTAL)

    def full_state(self) -> dict[str, Any]:
        """Every value of the model, optimizers and schedulers, gathered (to compare)."""
        out: dict[str, Any] = {"train_state": self.train_state.step}
        for key, value in self.model.state_dict().items():
            out[f"model.{key}"] = value.full_tensor()
        for key, value in self.optimizers.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            elif isinstance(value, torch.Tensor):  # a step count: live, changed in place
                value = value.clone()
            out[f"optim.{key}"] = value
        out["lr_scheduler"] = self.lr_schedulers.state_dict()
        out["lr"] = [group["lr"] for group in self.optimizers.optimizers[0].param_groups]
        return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def config(**fields: Any) -> ShardwiseCheckpointManager.Config:
    return ShardwiseCheckpointManager.Config(
        enable=True, interval=2, last_save_model_only=False, **fields
    )


def uninterrupted(dump: str) -> dict[str, Any]:
    job = Job(ShardwiseCheckpointManager.Config(enable=False), dump)
    job.train(TOTAL)
    return job.full_state()


# -- 2 ranks: resume equals an uninterrupted run, and equals torchtitan's DCP manager ---------


def resume_body(dump: str) -> None:
    want = uninterrupted(dump)

    # The first run saves with our backend and with torchtitan's DCP manager, side by side.
    first = Job(config(folder="shardwise", keep_latest_k=2), dump)
    dcp = DCPManager.Config(enable=True, interval=2, folder="dcp", keep_latest_k=0).build(
        dataloader=None,
        model_parts=[first.model],
        optimizers=first.optimizers,
        lr_schedulers=first.lr_schedulers,
        states={"train_state": first.train_state},
        sd_adapter=None,
        base_folder=dump,
    )
    first.checkpointer.load()
    for step in range(1, 5):
        first.train(step, load=False)
        dcp.save(step)
    first.checkpointer.close()
    dcp.close()
    at_step_4 = first.full_state()
    if dist.get_rank() == 0:
        # keep_latest_k=2: steps 2 and 4; shardwise's step names
        assert sorted(os.listdir(os.path.join(dump, "shardwise"))) == [
            "step-00000002",
            "step-00000004",
        ]

    # What each backend restores, into fresh objects (another seed: nothing left by chance).
    ours = Job(config(folder="shardwise"), dump, seed=1)
    ours.checkpointer.load()
    theirs = Job(ShardwiseCheckpointManager.Config(enable=False), dump, seed=1)
    reader = DCPManager.Config(enable=True, folder="dcp").build(
        dataloader=None,
        model_parts=[theirs.model],
        optimizers=theirs.optimizers,
        lr_schedulers=theirs.lr_schedulers,
        states={"train_state": theirs.train_state},
        sd_adapter=None,
        base_folder=dump,
    )
    assert reader.load() is True
    reader.close()
    assert ours.train_state.step == 4
    assert_same(ours.full_state(), theirs.full_state())
    assert_same(ours.full_state(), at_step_4)

    # Resumed to the end: the same as the run never interrupted.
    ours.train(TOTAL)
    ours.checkpointer.close()
    assert_same(ours.full_state(), want)


def test_resume_equals_uninterrupted_and_dcp(tmp_path: Any) -> None:
    run_on_ranks(resume_body, 2, args=(str(tmp_path),), timeout=120)


# -- 4 ranks save, 2 resume -------------------------------------------------------------------


def save_on_four(dump: str) -> None:
    job = Job(config(folder="ckpt", async_save=False), dump)
    job.train(4)
    job.checkpointer.close()


def resume_on_two(dump: str) -> None:
    want = uninterrupted(dump)
    job = Job(config(folder="ckpt"), dump, seed=1)
    job.train(TOTAL)  # loads step 4 (saved by 4 ranks), trains to the end
    job.checkpointer.close()
    assert_same(job.full_state(), want)


def test_resume_on_another_world_size(tmp_path: Any) -> None:
    run_on_ranks(save_on_four, 4, args=(str(tmp_path),), timeout=120)
    run_on_ranks(resume_on_two, 2, args=(str(tmp_path),), timeout=120)


# -- a corrupt newest checkpoint is skipped ------------------------------------------------


def corrupt_body(dump: str) -> None:
    job = Job(config(folder="ckpt"), dump)
    job.train(2)
    at_step_2 = job.full_state()
    job.train(4)
    job.checkpointer.close()
    if dist.get_rank() == 0:
        data = os.path.join(dump, "ckpt", "step-00000004", "data")
        name = sorted(os.listdir(data))[0]
        with open(os.path.join(data, name), "r+b") as file:
            file.seek(-9, os.SEEK_END)
            byte = file.read(1)
            file.seek(-9, os.SEEK_END)
            file.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    fresh = Job(config(folder="ckpt"), dump, seed=1)
    with pytest.warns(RestoreFallbackWarning, match="step-00000004"):
        assert fresh.checkpointer.load() is True
    assert fresh.train_state.step == 2
    assert_same(fresh.full_state(), at_step_2)
    fresh.checkpointer.close()


def test_corrupt_newest_is_skipped(tmp_path: Any) -> None:
    run_on_ranks(corrupt_body, 2, args=(str(tmp_path),), timeout=120)


# -- the local tier: a restart restores the newest local step, from a peer's replica -------


def local_config(dump: str, folder: str, **fields: Any) -> ShardwiseCheckpointManager.Config:
    """Durable saves every 2 steps into ``folder``, a local one every step: each rank a node
    of its own (LOCAL_WORLD_SIZE=1), its tier directory under the dump folder."""
    return ShardwiseCheckpointManager.Config(
        enable=True,
        folder=folder,
        local_interval=1,
        local_job_id="titan",
        local_directory=os.path.join(dump, f"{folder}-node{dist.get_rank()}"),
        **fields,
    )


def local_tier_body(dump: str) -> None:
    want = uninterrupted(dump)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        # Steps 1-5: durable 2 and 4, local 4 and 5 (each part held by both ranks).
        first = Job(local_config(dump, "ckpt", interval=2, last_save_model_only=False), dump)
        first.train(5)
        first.checkpointer.close()
        at_step_5 = first.full_state()
        if dist.get_rank() == 0:  # node 0 lost with its memory
            shutil.rmtree(os.path.join(dump, "ckpt-node0"))
        dist.barrier()
        fresh = Job(local_config(dump, "ckpt", interval=2, last_save_model_only=False), dump, 1)
        assert fresh.checkpointer.load() is True
        assert fresh.train_state.step == 5  # newer than the folder's step 4: the local step
        assert_same(fresh.full_state(), at_step_5)
        fresh.train(TOTAL)
        fresh.checkpointer.close()
        assert_same(fresh.full_state(), want)

        # A seed checkpoint (the model alone, step 0), then steps 1-3 saved locally only: a
        # restart takes local step 3, the whole state, not the seed.
        seeded = local_config(dump, "seeded", interval=100)
        Job(seeded, dump).checkpointer.save(curr_step=0, last_step=True)
        job = Job(seeded, dump, seed=1)
        job.train(3)  # loads the seed (no local step yet), then trains from it
        job.checkpointer.close()
        again = Job(seeded, dump, seed=2)
        assert again.checkpointer.load() is True
        assert again.train_state.step == 3
        assert_same(again.full_state(), job.full_state())
        again.checkpointer.close()
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def test_local_tier_restores_a_newer_step_than_the_folder(tmp_path: Any) -> None:
    run_on_ranks(local_tier_body, 2, args=(str(tmp_path),), timeout=120)


# -- Hugging Face: initial load, last save -------------------------------------------------


def hf_body(dump: str, source: str) -> dict[str, torch.Tensor]:
    checkpoint = ShardwiseCheckpointManager.Config(
        enable=True,
        interval=100,
        folder="ckpt",
        initial_load_path=source,
        initial_load_in_hf=True,
        last_save_in_hf=True,
        export_dtype="bfloat16",
    )
    job = Job(checkpoint, dump, seed=1)
    job.checkpointer.load()
    adapter = llama3.Llama3StateDictAdapter(job.config, None)
    loaded = adapter.to_hf({k: v.full_tensor() for k, v in job.model.state_dict().items()})
    job.train(TOTAL)  # step TOTAL is the last: saved as Hugging Face safetensors
    job.checkpointer.close()
    trained = adapter.to_hf({k: v.full_tensor() for k, v in job.model.state_dict().items()})
    return {**{f"loaded.{k}": v for k, v in loaded.items()}, **trained}


def test_hf_initial_load_and_last_save(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.LlamaConfig(
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        vocab_size=VOCAB,
        tie_word_embeddings=False,
    )
    torch.manual_seed(7)
    source = transformers.LlamaForCausalLM(hf_config)
    source.save_pretrained(tmp_path / "source")
    original = {k: v.detach().clone() for k, v in source.state_dict().items()}

    result = run_on_ranks(hf_body, 2, args=(str(tmp_path), str(tmp_path / "source")))[0]
    # The initial load put the Hugging Face weights into the model (through its sd_adapter).
    for key, value in original.items():
        assert torch.equal(result[f"loaded.{key}"], value), key

    export = tmp_path / "ckpt" / ("step-00000006" + HF_SUFFIX)
    hf_config.save_pretrained(export)  # torchtitan's export holds the weights alone
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notices
        exported = transformers.LlamaForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    got = exported.state_dict()
    changed = False
    for key, value in original.items():
        want = result[key].to(torch.bfloat16)
        assert torch.equal(got[key], want), key
        changed = changed or not torch.equal(want, value.to(torch.bfloat16))
    assert changed  # training moved the weights: the export is the trained model
