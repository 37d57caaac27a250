"""What one step of the slot table hands on, against references written out here: a guided row's x0_hat is
blind + w (x0_hat - blind) of the denoiser's two answers, a prompt's positions are forward-noised with the draws of
the sample's own prefix stream, a batch of two samplers keeps its padding at zero, and the fused step hands its
callable the table's schedule, its unpadded rows without a mask and the sde noise in the table's dtype. Samples are
built from their own seeded streams, so every draw is known here."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from ldlm.model.config import preset
from ldlm.sampling import GenerateRequest, SampleState, resolve
from ldlm.sampling.loop import fused_step
from ldlm.sampling.noise import NoiseStream
from ldlm.sampling.samplers import Sampler, get_sampler
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.slots import SlotTable
from ldlm.sampling.step import SlotStep

CONFIG = preset("tiny")
SCHEDULE = TangentSchedule()
D = 4


def sample(
    sampler: str | Sampler = "ddim",
    length: int = 6,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    prefix: Tensor | None = None,
    guidance: Tensor | None = None,
) -> SampleState:
    """A 4-step sample whose noise stream is NoiseStream(seed) and whose prefix stream is NoiseStream(seed + 100)."""
    method = get_sampler(sampler) if isinstance(sampler, str) else sampler
    times = resolve(GenerateRequest(1, length, 4, 0, method.name), CONFIG).times(SCHEDULE).to(dtype)
    prior = torch.randn(length, D, generator=torch.Generator().manual_seed(seed + 50)).to(dtype)
    prefix_noise = None if prefix is None else NoiseStream(seed + 100, tuple(prefix.shape))
    return SampleState(method, times, NoiseStream(seed, (length, D)), prior, prefix, prefix_noise, guidance)


def context(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
    """Every position reads the mean of its row's real positions (as attention does), so a row that does not see
    the prompt answers otherwise than one that does."""
    real = (torch.ones(x_t.shape[:2], dtype=torch.bool) if mask is None else mask)[..., None].to(x_t.dtype)
    mean = (x_t * real).sum(1, keepdim=True) / real.sum(1, keepdim=True)
    return torch.tanh(0.7 * x_t + 0.9 * mean + 0.3 * x0_prev + t[:, None, None]) * real


def recording(denoise, calls: list):  # type: ignore[no-untyped-def]
    def call(x_t, t, x0_prev, mask):  # type: ignore[no-untyped-def]
        out = denoise(x_t, t, x0_prev, mask)
        calls.append((x_t.clone(), t.clone(), mask, out.clone()))
        return out

    return call


@pytest.mark.parametrize("answer", [torch.float32, torch.bfloat16], ids=["fp32-denoiser", "bf16-denoiser"])
def test_a_guided_row_is_blind_plus_w_times_its_difference_from_its_blind_copy(answer: torch.dtype) -> None:
    """An unguided sample and a guided one (prompt of 2, strength 2.5) in one table: the denoiser sees 3 rows (the
    guided one's blind copy last); the guided row's x0_hat is blind + w (guided - blind), w 1 at the prompt and 2.5
    after, the other row's the denoiser's answer. A denoiser answering in bfloat16 (autocast) is combined alike."""
    prompt = torch.randn(2, D, generator=torch.Generator().manual_seed(7))
    w = torch.tensor([1.0, 1.0, 2.5, 2.5, 2.5, 2.5])[:, None]
    plain, guided = sample(seed=1), sample(seed=2, prefix=prompt, guidance=w)
    calls: list = []
    table = SlotTable(SCHEDULE, 6)
    table.run([plain, guided])
    table.step(recording(lambda *a: context(*a).to(answer), calls))
    ((_, _, mask, out),) = calls
    assert mask.tolist()[2] == [False, False] + [True] * 4  # the blind copy: the prompt out
    out = out.float()
    expected = out[2] + w * (out[1] - out[2])
    assert not torch.allclose(expected, out[1], atol=1e-2)  # guidance changes something here
    tolerance = {"rtol": 0, "atol": 0} if answer == torch.float32 else {"rtol": 2**-7, "atol": 2**-7}
    torch.testing.assert_close(table.rows("x0_hat", [guided])[0], expected, **tolerance)
    torch.testing.assert_close(table.rows("x0_hat", [plain])[0], out[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_a_prompt_is_forward_noised_with_its_own_prefix_stream(dtype: torch.dtype) -> None:
    """A prompted DDIM sample: at each step the denoiser's x_t at the prompt's positions is alpha(t) prompt +
    sigma(t) eps with eps the prefix stream's next draw, in the table's dtype (float16 and float64 too)."""
    prompt = torch.randn(2, D, generator=torch.Generator().manual_seed(7)).to(dtype)
    calls: list = []
    table = SlotTable(SCHEDULE, 8)
    table.run([sample(prefix=prompt, dtype=dtype, seed=3)])
    for _ in range(3):
        table.step(recording(context, calls))
    reference = NoiseStream(103, (2, D))
    for x_t, t, _, _ in calls:
        assert x_t.dtype == dtype
        eps, tt = reference.draw().double(), t.double()
        expected = SCHEDULE.alpha(tt) * prompt.double() + SCHEDULE.sigma(tt) * eps
        tolerance = 2e-3 if dtype == torch.float16 else 1e-6
        torch.testing.assert_close(x_t[0, :2].double(), expected, rtol=tolerance, atol=tolerance)


def test_two_samplers_in_one_batch_keep_a_short_sample_s_padding_at_zero() -> None:
    """DDIM and dpm2m side by side (two groups of rows), the dpm2m sample 4 positions shorter than the table, and a
    denoiser that answers 1 everywhere, padding included: the short sample's state stays zero past its length."""
    short, full = sample("dpm2m", length=4, seed=1), sample("ddim", length=8, seed=2)
    table = SlotTable(SCHEDULE, 8)
    table.run([full, short])
    for _ in range(2):
        table.step(lambda x_t, t, x0_prev, mask: torch.ones_like(x_t))
        for name in ("x", "x_mean", "x0_hat", "x0_prev"):
            row = table.rows(name, [short])[0]
            assert torch.equal(row[4:], torch.zeros(4, D)), name
            assert row[:4].abs().sum() > 0, name


def test_a_fused_step_passes_no_mask_to_unpadded_rows_and_a_mask_to_padded_ones() -> None:
    calls: list = []
    step = fused_step(recording(context, calls))
    full = [sample(length=8, seed=s) for s in (1, 2)]
    short = sample(length=5, seed=3)
    table = SlotTable(SCHEDULE, 8)
    table.run(full)
    table.step_fused(step)
    table.run(full + [short])
    table.step_fused(step)
    assert calls[0][2] is None
    assert calls[1][2].tolist() == [[True] * 8] * 2 + [[True] * 5 + [False] * 3]


@dataclass(frozen=True)
class OnTheSpot(Sampler):
    """A sampler that computes its coefficients from the schedule at every step (it redefines ``step``)."""

    def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return super().step(*args, **kwargs)


def test_a_fused_step_of_a_sampler_that_reads_the_schedule_equals_the_unfused_step() -> None:
    method = OnTheSpot(**vars(get_sampler("dpm2m")))
    assert not method.tabulated
    latents = []
    for fused in (False, True):
        table, one = SlotTable(SCHEDULE, 8), sample(method, seed=4)
        table.run([one])
        while table.running:
            if fused:
                table.step_fused(fused_step(context))
            else:
                table.step(context)
        latents.append(one.latent)
    torch.testing.assert_close(latents[1], latents[0], rtol=0, atol=0)


def test_a_fused_sde_step_gets_each_sample_s_own_draw_in_the_table_s_dtype() -> None:
    """Two float64 sde samples, one shorter than the table: the fused callable's noise is each sample's stream's next
    draw, cast to float64 and zero-padded to the table's length."""
    samples = [sample("sde", length=8, seed=5, dtype=torch.float64), sample("sde", length=6, seed=6, dtype=torch.float64)]
    handed: list[Tensor] = []
    step = fused_step(context)

    def keeping(sampler: Sampler, schedule: TangentSchedule, rows: SlotStep) -> None:
        handed.append(rows.noise.clone())  # type: ignore[union-attr]
        step(sampler, schedule, rows)

    table = SlotTable(SCHEDULE, 8)
    table.run(samples)
    table.step_fused(keeping)
    table.step_fused(keeping)
    streams = NoiseStream(5, (8, D)), NoiseStream(6, (6, D))
    for noise in handed:
        assert noise.dtype == torch.float64
        draws = [s.draw().double() for s in streams]
        expected = torch.stack([draws[0], torch.cat([draws[1], torch.zeros(2, D, dtype=torch.float64)])])
        torch.testing.assert_close(noise, expected, rtol=0, atol=0)


def test_a_fused_step_refusing_guided_rows_says_how_many() -> None:
    prompt = torch.zeros(2, D)
    guided = sample(prefix=prompt, guidance=torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0, 2.0])[:, None])
    table = SlotTable(SCHEDULE, 8)
    table.run([sample(seed=1), guided])
    with pytest.raises(ValueError, match=r"these rows have samplers \['ddim'\] and 1 guided"):
        table.step_fused(fused_step(context))
