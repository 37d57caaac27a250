"""The TensorRT runtime's logic on CPU: batch splitting, checked binding, one context per profile,
bind + enqueue under a lock across threads, dtypes, the RTX runtime cache file, the service limits.

TensorRT cannot execute without a GPU, so ``PlanExecutor`` runs here on a *stand-in* for an
ICudaEngine (``StandInEngine``): it answers the same calls, and its ``execute_async_v3`` really reads
the inputs at the addresses bound and writes y = 2x + mask at the output's address (host memory,
through ctypes), so a wrong address, a wrong shape or another thread's binding gives wrong numbers.
What it does not exercise: real TensorRT kernels, CUDA streams, CUDA graph capture and replay
(``tests/export/test_engine_builder.py::test_engine_runs_on_gpu`` covers those on a GPU).
"""

from __future__ import annotations

import ctypes
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from ldlm.export.artifact import PlanMismatchError
from ldlm.files import write_atomically
from ldlm.model.config import LDLMConfig
from ldlm.serve.runtime.backends import serving_limits
from ldlm.serve.runtime.tensorrt_executor import TORCH_DTYPES, PlanExecutor, batch_chunks, torch_dtype
from ldlm.serve.runtime.trt_runtime import RuntimeCacheFile, runtime_cache_path

STAND_IN_TRT = types.SimpleNamespace(TensorIOMode=types.SimpleNamespace(INPUT="INPUT", OUTPUT="OUTPUT"))
AXES = {"x": {"batch": 0, "seq": 1}, "mask": {"batch": 0, "seq": 1}, "y": {"batch": 0, "seq": 1}}
WIDTH = 3


def host_array(address: int, shape: tuple[int, ...], ctype: type) -> np.ndarray:
    count = int(np.prod(shape))
    return np.ctypeslib.as_array((ctype * count).from_address(address)).reshape(shape)


class StandInContext:
    """Stand-in for IExecutionContext: records every call (thread, call) in ``engine.events``."""

    def __init__(self, engine: StandInEngine) -> None:
        self.engine = engine
        self.profile: int | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}

    def _event(self, call: str) -> None:
        self.engine.events.append((threading.get_ident(), call))

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.profile = index
        self._event(f"profile {index}")
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self._event(f"shape {name}")
        (bmin, bmax), (smin, smax) = self.engine.profiles[self.profile]
        if name in self.engine.reject or not (bmin <= shape[0] <= bmax and smin <= shape[1] <= smax):
            return False
        self.shapes[name] = tuple(shape)
        time.sleep(0.0002)  # widen the window in which another thread could rebind
        return True

    def set_tensor_address(self, name: str, address: int) -> bool:
        self._event(f"address {name}")
        if name in self.engine.reject:
            return False
        self.addresses[name] = address
        time.sleep(0.0002)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return (*self.shapes["x"],) if name == "y" else self.shapes[name]

    def execute_async_v3(self, stream: int) -> bool:
        self._event("execute")
        shape = self.shapes["x"]
        x = host_array(self.addresses["x"], shape, ctypes.c_float)
        mask = host_array(self.addresses["mask"], self.shapes["mask"], ctypes.c_int64)
        y = host_array(self.addresses["y"], shape, ctypes.c_float)
        y[...] = 2 * x + mask[..., None]
        self.engine.executed.append(shape[0])
        return True


class StandInEngine:
    """Stand-in for ICudaEngine: inputs x (batch, seq, 3) float32 and mask (batch, seq) int64,
    output y (batch, seq, 3) float32; one optimization profile per ((batch min, max), (seq min, max))."""

    def __init__(self, profiles: list[tuple[tuple[int, int], tuple[int, int]]], reject: tuple[str, ...] = ()) -> None:
        self.profiles = profiles
        self.reject = reject
        self.events: list[tuple[int, str]] = []
        self.executed: list[int] = []
        self.contexts: list[StandInContext] = []
        self.names = ["x", "mask", "y"]
        self.num_io_tensors = 3
        self.num_optimization_profiles = len(profiles)

    def get_tensor_name(self, index: int) -> str:
        return self.names[index]

    def get_tensor_mode(self, name: str) -> str:
        return "OUTPUT" if name == "y" else "INPUT"

    def get_tensor_dtype(self, name: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="INT64" if name == "mask" else "FLOAT")

    def get_tensor_profile_shape(self, name: str, index: int) -> tuple[tuple[int, ...], ...]:
        (bmin, bmax), (smin, smax) = self.profiles[index]
        extra = (WIDTH,) if name == "x" else ()
        return (bmin, smin, *extra), (bmax, smax, *extra), (bmax, smax, *extra)

    def create_execution_context(self, *args: object) -> StandInContext:
        self.contexts.append(StandInContext(self))
        return self.contexts[-1]


def executor(engine: StandInEngine) -> PlanExecutor:
    return PlanExecutor(engine, STAND_IN_TRT, "stand-in.plan", AXES, torch.device("cpu"))


def feed(batch: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, seq, WIDTH, generator=g), "mask": torch.randint(0, 5, (batch, seq), generator=g)}


def reference(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return 2 * inputs["x"] + inputs["mask"][..., None].float()


def test_batch_chunks_fill_the_profiles_largest_first() -> None:
    assert batch_chunks(7, [(1, 32)]) == [7]
    assert batch_chunks(70, [(1, 32)]) == [32, 32, 6]
    assert batch_chunks(64, [(1, 32)]) == [32, 32]
    assert batch_chunks(6, [(1, 4), (8, 32)]) == [4, 2]  # 6 falls in the gap between the two profiles
    assert batch_chunks(41, [(1, 4), (8, 32)]) == [32, 9]
    with pytest.raises(ValueError, match=r"batch 3 cannot be split .*\(4, 8\)"):
        batch_chunks(3, [(4, 8)])
    with pytest.raises(ValueError, match="batch=0 is out of range"):
        batch_chunks(0, [(1, 4)])


def test_stand_in_engine_runs_a_batch_beyond_its_profile_in_chunks() -> None:
    engine = StandInEngine([((1, 4), (1, 16))])
    run = executor(engine)
    assert (run.max_batch, run.max_seq) == (4, 16)
    batch_only = PlanExecutor(engine, STAND_IN_TRT, "stand-in.plan", {n: {"batch": 0} for n in AXES}, torch.device("cpu"))
    assert (batch_only.max_batch, batch_only.max_seq) == (4, None)  # no sequence axis: no sequence limit
    inputs = feed(10, 5)
    out = run.execute(inputs, stream=0)["y"]
    assert engine.executed == [4, 4, 2]
    torch.testing.assert_close(out, reference(inputs), rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside every profile of stand-in.plan"):
        run.execute(feed(2, 17), stream=0)  # a sequence longer than every profile is not split


def test_stand_in_engine_keeps_one_context_per_profile() -> None:
    engine = StandInEngine([((1, 4), (1, 16)), ((5, 32), (1, 16))])
    run = executor(engine)
    for batch in (3, 8, 2, 32, 40):
        inputs = feed(batch, 4, seed=batch)
        torch.testing.assert_close(run.execute(inputs, stream=0)["y"], reference(inputs), rtol=0, atol=0)
    assert [c.profile for c in engine.contexts] == [0, 1]
    assert engine.executed == [3, 8, 2, 32, 32, 8]
    assert run.max_batch == 32


def test_stand_in_engine_two_threads_never_interleave_bind_and_execute() -> None:
    """The scheduler's thread and a batcher's thread share one engine: each call's shapes and
    addresses must stay its own until it is enqueued, or the execution reads the other's inputs."""
    engine = StandInEngine([((1, 4), (1, 16))])
    run = executor(engine)
    errors: list[str] = []

    def worker(seed: int) -> None:
        for i in range(25):
            inputs = feed(1 + (seed + i) % 4, 2 + (seed * i) % 14, seed=seed * 1000 + i)
            got = run.execute(inputs, stream=0)["y"]
            if got.shape != reference(inputs).shape or not torch.equal(got, reference(inputs)):
                errors.append(f"thread {seed} call {i}: wrong output")

    threads = [threading.Thread(target=worker, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # every execute follows binds made by its own thread only
    owner = None
    for thread, call in engine.events:
        if call.startswith(("shape", "address")):
            assert owner in (None, thread), "another thread rebound the context before this call was enqueued"
            owner = thread
        elif call == "execute":
            assert owner == thread
            owner = None


def test_stand_in_engine_checks_what_tensorrt_returns() -> None:
    with pytest.raises(RuntimeError, match="rejected shape .* for input mask"):
        executor(StandInEngine([((1, 4), (1, 16))], reject=("mask",))).execute(feed(2, 4), stream=0)
    with pytest.raises(RuntimeError, match="rejected the address of tensor y"):
        executor(StandInEngine([((1, 4), (1, 16))], reject=("y",))).execute(feed(2, 4), stream=0)
    with pytest.raises(ValueError, match=r"missing inputs \['mask'\]"):
        executor(StandInEngine([((1, 4), (1, 16))])).execute({"x": torch.zeros(1, 2, WIDTH)}, stream=0)


def test_every_tensorrt_io_dtype_with_a_torch_dtype_maps() -> None:
    assert TORCH_DTYPES["UINT8"] is torch.uint8 and TORCH_DTYPES["FP8"] is torch.float8_e4m3fn
    assert torch_dtype("BF16", "x") is torch.bfloat16
    with pytest.raises(PlanMismatchError, match="tensor w has TensorRT dtype INT4, which has no torch dtype"):
        torch_dtype("INT4", "w")
    trt = pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is not installed: its DataType list was not compared")
    unmapped = {m for m in dir(trt.DataType) if m.isupper()} - set(TORCH_DTYPES)
    assert unmapped == {"INT4", "FP4", "E8M0"}  # packed or scale-only: no torch tensor holds them


class StandInRuntimeCache:
    """Stand-in for TensorRT-RTX's IRuntimeCache: a blob that deserializes only if it starts with b'ok'."""

    def __init__(self) -> None:
        self.blob = b""

    def deserialize(self, blob: bytes) -> bool:
        if not bytes(blob).startswith(b"ok"):
            return False
        self.blob = bytes(blob)
        return True

    def serialize(self) -> bytes:
        return self.blob + b"+more kernels"


class StandInRuntimeConfig:
    """Stand-in for IRuntimeConfig: hands out caches, accepts one unless told to refuse."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.cache: StandInRuntimeCache | None = None

    def create_runtime_cache(self) -> StandInRuntimeCache:
        return StandInRuntimeCache()

    def set_runtime_cache(self, cache: StandInRuntimeCache) -> bool:
        self.cache = cache
        return self.accept

    def get_runtime_cache(self) -> StandInRuntimeCache | None:
        return self.cache


def test_runtime_cache_is_one_file_per_plan_loaded_checked_and_saved(tmp_path: Path) -> None:
    paths = {runtime_cache_path(tmp_path / f"{g}.plan") for g in ("encoder", "denoiser", "decoder")}
    assert paths == {tmp_path / f"{g}.runtime.cache" for g in ("encoder", "denoiser", "decoder")}

    fresh = RuntimeCacheFile(tmp_path / "denoiser.runtime.cache")
    fresh.attach(StandInRuntimeConfig())
    assert fresh.loaded is False and fresh.save().read_bytes() == b"+more kernels"

    (tmp_path / "encoder.runtime.cache").write_bytes(b"ok kernels")
    kept = RuntimeCacheFile(tmp_path / "encoder.runtime.cache")
    kept.attach(StandInRuntimeConfig())
    assert kept.loaded is True and kept.save().read_bytes() == b"ok kernels+more kernels"

    (tmp_path / "decoder.runtime.cache").write_bytes(b"from another driver")
    stale = RuntimeCacheFile(tmp_path / "decoder.runtime.cache")
    stale.attach(StandInRuntimeConfig())
    assert stale.loaded is False  # rebuilt empty, not an error

    with pytest.raises(RuntimeError, match="refused the runtime cache"):
        RuntimeCacheFile(tmp_path / "x.runtime.cache").attach(StandInRuntimeConfig(accept=False))
    assert RuntimeCacheFile(tmp_path / "never.runtime.cache").save() is None  # never attached: nothing to keep
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decoder.runtime.cache", "denoiser.runtime.cache", "encoder.runtime.cache"]


def test_atomic_writes_from_many_threads_leave_one_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "plan.runtime.cache"
    blobs = [bytes([i]) * 200_000 for i in range(8)]
    threads = [threading.Thread(target=write_atomically, args=(target, b)) for b in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert target.read_bytes() in blobs
    assert [p.name for p in tmp_path.iterdir()] == ["plan.runtime.cache"]


def test_service_limits_follow_the_narrowest_graph() -> None:
    config = LDLMConfig()
    plain = {g: types.SimpleNamespace(max_seq_len=config.max_seq_len, batch_limit=None) for g in ("encoder", "denoiser", "decoder")}
    same, batch = serving_limits(plain, config, 16)  # ONNX Runtime, torch: no profile
    assert same is config and batch == 16
    narrow = dict(
        plain,
        denoiser=types.SimpleNamespace(max_seq_len=config.max_seq_len // 2, batch_limit=8),
        decoder=types.SimpleNamespace(max_seq_len=config.max_seq_len, batch_limit=32),
    )
    capped, batch = serving_limits(narrow, config, 16)
    assert capped.max_seq_len == config.max_seq_len // 2 and batch == 8
    assert {k: v for k, v in vars(capped).items() if k != "max_seq_len"} == {k: v for k, v in vars(config).items() if k != "max_seq_len"}
