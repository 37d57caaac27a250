"""The solvers against independent references: a Gaussian oracle's exact ODE solution, the order of
convergence it implies, hand-written first-order steps, and single runs of the real tiny model.

The oracle: for data x0 ~ N(mu, s^2 I) the ideal denoiser is E[x0 | x_t] = mu + alpha s^2 (x_t - alpha mu)
/ (alpha^2 s^2 + sigma^2), and along the probability-flow ODE the standardized value
(x_t - alpha_t mu) / sqrt(alpha_t^2 s^2 + sigma_t^2) is constant, so the exact x at t_min is known from
the prior x_1 alone. The oracle ignores the self-conditioning input.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ldlm.model.config import SAMPLERS
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import run_sampler
from ldlm.sampling.samplers import SAMPLERS_BY_NAME, ddim_step, get_sampler
from ldlm.sampling.schedule import TangentSchedule, time_grid
from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler

SCHEDULE = TangentSchedule(d=3.0, beta_clip_t=0.95)
F64 = torch.float64
MU, S, T_MIN = 0.3, 0.5, 0.05
PRIOR = torch.randn(2, 256, 8, generator=torch.Generator().manual_seed(0), dtype=F64)


def oracle_denoiser(x_t: torch.Tensor, t: torch.Tensor, x0_prev: torch.Tensor) -> torch.Tensor:
    a, sg = SCHEDULE.alpha(t)[:, None, None], SCHEDULE.sigma(t)[:, None, None]
    return MU + a * S**2 * (x_t - a * MU) / (a**2 * S**2 + sg**2)


def exact_solution(t_min: float = T_MIN) -> torch.Tensor:
    t = torch.tensor(t_min, dtype=F64)
    alpha, sigma = SCHEDULE.alpha(t), SCHEDULE.sigma(t)
    return alpha * MU + torch.sqrt(alpha**2 * S**2 + sigma**2) * PRIOR  # at t = 1: alpha = 0, sigma = 1


def oracle_error(sampler: str, steps: int, grid: str | None = None) -> float:
    solver = get_sampler(sampler)
    times = time_grid(steps, T_MIN, grid or solver.grid, SCHEDULE)
    x = run_sampler(oracle_denoiser, PRIOR, lambda: torch.zeros_like(PRIOR), times, SCHEDULE, sampler)
    exact = exact_solution()
    return ((x - exact).norm() / exact.norm()).item()


def observed_order(sampler: str, steps: tuple[int, ...] = (50, 100, 200)) -> float:
    errors = [oracle_error(sampler, n) for n in steps]
    return -float(np.polyfit(np.log(steps), np.log(errors), 1)[0])


def test_the_oracle_is_exact_for_the_exact_ode() -> None:
    """Guard for the oracle itself: DDIM at many steps converges to it (so the closed form is the ODE's)."""
    assert oracle_error("ddim", 2000) < 1e-3
    assert oracle_error("ddim", 20) > 10 * oracle_error("ddim", 2000)


@pytest.mark.parametrize(
    ("sampler", "low", "high"),
    [("ddim", 0.9, 1.15), ("dpm2m", 1.8, 2.6), ("dpm3m", 2.3, 3.6), ("dpm3m-psc", 2.3, 3.6), ("dpm3m-psc-unic", 2.8, 4.2)],
)
def test_observed_order_of_convergence(sampler: str, low: float, high: float) -> None:
    order = observed_order(sampler)
    assert low <= order <= high, f"{sampler}: observed order {order:.2f}, expected {low}..{high}"


def test_few_steps_of_the_multistep_solvers_beat_fifty_ddim_steps() -> None:
    ddim_50 = oracle_error("ddim", 50)
    for sampler in ("dpm2m", "dpm3m", "dpm3m-psc", "dpm3m-psc-unic"):
        assert oracle_error(sampler, 15) <= ddim_50, sampler


def test_the_corrector_raises_the_predictors_accuracy() -> None:
    """UniC adds an order over the same denoiser calls: on the oracle, at 15 and 50 steps, the corrected
    dpm3m-psc lands far closer to the exact solution than dpm3m-psc (measured 1.5e-3 vs 3.5e-3, 6.5e-6 vs 1.1e-4)."""
    for steps, factor in ((15, 2), (50, 10)):
        assert oracle_error("dpm3m-psc-unic", steps) * factor < oracle_error("dpm3m-psc", steps), steps


def test_first_step_and_one_step_runs_are_exactly_ddim() -> None:
    """From t = 1 (lambda = -inf) there is no past to extrapolate: every deterministic solver's first step
    is the DDIM step, and a one-step run of a multistep method is a DDIM run."""
    assert SCHEDULE.log_snr(torch.tensor([1.0])).item() == -math.inf
    x, x0 = PRIOR, oracle_denoiser(PRIOR, torch.ones(2, dtype=F64), torch.zeros_like(PRIOR))
    t, t_next = torch.ones(2, dtype=F64), torch.full((2,), 0.8, dtype=F64)
    expected = ddim_step(SCHEDULE, x, x0, t, t_next)
    for name in ("ddim", "dpm2m", "dpm3m", "dpm3m-psc", "dpm3m-psc-unic"):
        result = SAMPLERS_BY_NAME[name].step(SCHEDULE, x, x0, t, t_next, [])
        assert torch.equal(result.x, expected), name
        one_step = run_sampler(
            oracle_denoiser, PRIOR, lambda: None, time_grid(1, T_MIN, SAMPLERS_BY_NAME[name].grid, SCHEDULE), SCHEDULE, name
        )
        hand = ddim_step(SCHEDULE, PRIOR, x0, t, torch.full((2,), T_MIN, dtype=F64))
        torch.testing.assert_close(one_step, hand, rtol=0, atol=0, msg=name)


def test_second_order_step_by_hand() -> None:
    """dpm2m's step against the formula written out for one scalar sample (Lu et al. 2022, Alg. 2 with the
    phi weights): x' = sigma'/sigma x + alpha' (1 - e^-h) (m0 + c1 (m0 - m1) h / h0)."""
    t0, t1, t2 = 0.7, 0.6, 0.45
    lam = [-math.log(3 * math.tan(math.pi * t / 2)) for t in (t0, t1, t2)]
    h, h0 = lam[2] - lam[1], lam[1] - lam[0]
    m0, m1, x = 0.4, 0.1, -0.3
    c1 = (math.expm1(-h) / h + 1) / -math.expm1(-h)
    a1 = 1 / math.sqrt(1 + 9 * math.tan(math.pi * t1 / 2) ** 2)
    s1 = math.sqrt(1 - a1**2)
    a2 = 1 / math.sqrt(1 + 9 * math.tan(math.pi * t2 / 2) ** 2)
    s2 = math.sqrt(1 - a2**2)
    expected = s2 / s1 * x + a2 * (-math.expm1(-h)) * (m0 + c1 * (m0 - m1) * h / h0)

    def scalar(v: float) -> torch.Tensor:
        return torch.full((1, 1, 1), v, dtype=F64)

    past = [(scalar(m1), torch.tensor([lam[0]], dtype=F64))]
    result = SAMPLERS_BY_NAME["dpm2m"].step(
        SCHEDULE, scalar(x), scalar(m0), torch.tensor([t1], dtype=F64), torch.tensor([t2], dtype=F64), past
    )
    assert result.x.item() == pytest.approx(expected, rel=1e-12)


def unic_x0_by_hand(m_t: float, m0: float, m1: float, lam_t: float, lam0: float, lam1: float) -> float:
    """UniC-2's x0 estimate (B(h) = e^h - 1, data prediction) from the paper's recursion: phi_k by
    phi_{k+1} = phi_k / h - 1 / (k+1)!, then the 2x2 system R rho = b solved by NumPy."""
    h = lam_t - lam0
    hh = -h
    rks = [(lam1 - lam0) / h, 1.0]
    phi, factorial, big_b = math.expm1(hh) / hh - 1, 1, math.expm1(hh)
    R, b = [], []
    for i in (1, 2):
        R.append([r ** (i - 1) for r in rks])
        b.append(phi * factorial / big_b)
        factorial *= i + 1
        phi = phi / hh - 1 / factorial
    rho = np.linalg.solve(np.array(R), np.array(b))
    return m0 + rho[0] * (m1 - m0) / rks[0] + rho[1] * (m_t - m0)


def test_corrector_step_by_hand() -> None:
    """dpm3m-psc-unic's correction for one scalar sample against UniC written out: the state at t1 redone
    from x_prev at t0 as sigma1/sigma0 x_prev + alpha1 (1 - e^-h) m_corr; the trapezoid without m1; and
    Adams-Moulton's weights (5/12, 8/12, -1/12) in the limit of small equal steps."""
    from ldlm.sampling.samplers import corrected_x0

    def alpha(t: float) -> float:
        return 1 / math.sqrt(1 + 9 * math.tan(math.pi * t / 2) ** 2)

    def lam(t: float) -> float:
        return -math.log(3 * math.tan(math.pi * t / 2))

    def scalar(v: float) -> torch.Tensor:
        return torch.full((1, 1, 1), v, dtype=F64)

    def one(v: float) -> torch.Tensor:
        return torch.tensor([v], dtype=F64)

    ts, t0, t1 = 0.75, 0.6, 0.45
    m_t, m0, m1, x, x_prev = 0.4, 0.1, -0.2, 0.7, -0.3
    past = [(scalar(m0), one(lam(t0))), (scalar(m1), one(lam(ts)))]
    m_corr = unic_x0_by_hand(m_t, m0, m1, lam(t1), lam(t0), lam(ts))
    h = lam(t1) - lam(t0)
    s0, s1 = math.sqrt(1 - alpha(t0) ** 2), math.sqrt(1 - alpha(t1) ** 2)
    expected = s1 / s0 * x_prev + alpha(t1) * -math.expm1(-h) * m_corr
    unic = SAMPLERS_BY_NAME["dpm3m-psc-unic"]
    got = unic.correct(SCHEDULE, scalar(x), scalar(x_prev), scalar(m_t), one(t0), one(t1), past)
    assert got.item() == pytest.approx(expected, rel=1e-12)
    assert SAMPLERS_BY_NAME["dpm3m-psc"].correct(SCHEDULE, scalar(x), scalar(x_prev), scalar(m_t), one(t0), one(t1), past).item() == x
    missing_m1 = [past[0], (scalar(m1), one(math.nan))]
    assert corrected_x0(scalar(m_t), one(lam(t1)), missing_m1).item() == pytest.approx((m_t + m0) / 2, rel=1e-15)
    step = 1e-4
    weights = [corrected_x0(scalar(a), one(step), [(scalar(b), one(0.0)), (scalar(c), one(-step))]).item() for a, b, c in np.eye(3)]
    np.testing.assert_allclose(weights, [5 / 12, 8 / 12, -1 / 12], atol=1e-4)
    no_past = [(scalar(m0), one(math.nan)), (scalar(m1), one(math.nan))]
    assert unic.correct(SCHEDULE, scalar(x), scalar(x_prev), scalar(m_t), one(t0), one(t1), no_past).item() == x


def test_missing_past_falls_back_per_sample() -> None:
    """Row 0 has a past, row 1's is missing (NaN lambda, as the scheduler marks it): row 1 gets DDIM."""
    x = PRIOR[:, :4]
    t, t_next = torch.tensor([0.6, 0.6], dtype=F64), torch.tensor([0.5, 0.5], dtype=F64)
    m0 = oracle_denoiser(x, t, x)
    m1 = oracle_denoiser(x, torch.tensor([0.7, 0.7], dtype=F64), x)
    lam1 = torch.tensor([SCHEDULE.log_snr(torch.tensor(0.7)).item(), math.nan], dtype=F64)
    result = SAMPLERS_BY_NAME["dpm3m"].step(SCHEDULE, x, m0, t, t_next, [(m1, lam1)])
    ddim = ddim_step(SCHEDULE, x, m0, t, t_next)
    assert torch.equal(result.x[1], ddim[1])
    assert not torch.allclose(result.x[0], ddim[0])


def test_extreme_times_give_finite_outputs() -> None:
    """Steps next to t = 1 and down to a tiny t_min, with pasts at t = 1 (lambda = -inf): never NaN."""
    x = PRIOR[:, :4]
    for name in SAMPLERS:
        solver = SAMPLERS_BY_NAME[name]
        for grid in ("uniform", "power", "logsnr"):
            times = time_grid(6, 1e-4, grid, SCHEDULE)
            out = run_sampler(oracle_denoiser, x, lambda: torch.randn_like(x), times, SCHEDULE, name)
            assert torch.isfinite(out).all(), (name, grid)
        t = torch.tensor([1 - 1e-7, 1 - 1e-7], dtype=F64)
        t_next = torch.tensor([1 - 2e-7, 1e-4], dtype=F64)
        past = [(x, SCHEDULE.log_snr(torch.ones(2))), (x, SCHEDULE.log_snr(torch.ones(2)))]
        result = solver.step(SCHEDULE, x, x, t, t_next, past[: solver.history], torch.zeros_like(x))
        assert torch.isfinite(result.x).all() and torch.isfinite(result.x0_prev).all(), name


def test_grids() -> None:
    uniform = time_grid(4, 0.2)
    torch.testing.assert_close(uniform, torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2], dtype=F64))
    power = time_grid(4, 0.2, "power")
    u = torch.tensor([0, 0.25, 0.5, 0.75, 1.0], dtype=F64)
    torch.testing.assert_close(power, 0.2 + 0.8 * (1 - u) ** 1.5)
    logsnr = time_grid(5, 0.05, "logsnr", SCHEDULE)
    assert logsnr[0] == 1.0 and logsnr[1] == pytest.approx(0.999) and logsnr[-1] == 0.05
    lam = -torch.log(3 * torch.tan(math.pi * logsnr[1:] / 2))  # independent of SCHEDULE.log_snr
    torch.testing.assert_close(lam.diff(), torch.full((4,), float(lam.diff()[0]), dtype=F64))
    with pytest.raises(ValueError, match="grid='cosine' is unknown; allowed: uniform, power, logsnr"):
        time_grid(4, 0.2, "cosine")


def test_unknown_solver_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="sampler='dpm9m' is unknown; allowed: sde, ddim, dpm2m, dpm3m, dpm3m-psc, dpm3m-psc-unic"):
        get_sampler("dpm9m")
    assert tuple(SAMPLERS_BY_NAME) == SAMPLERS


def test_predicted_self_conditioning_keeps_the_limit(pipeline: LDLMPipeline) -> None:
    """On the real tiny model: dpm3m-psc feeds the network something other than the last x0_hat, so it must
    still converge to the long DDIM run (today's sampler) as the steps grow."""
    reference = pipeline.sample_latents(2, 16, 300, seed=3, sampler="ddim")

    def error(steps: int, sampler: str = "dpm3m-psc") -> float:
        latents = pipeline.sample_latents(2, 16, steps, seed=3, sampler=sampler)
        return ((latents - reference).norm() / reference.norm()).item()

    coarse, fine = error(15), error(60)
    assert fine < coarse / 3, (coarse, fine)  # measured 0.056 -> 0.008
    assert coarse < error(15, "dpm3m")  # and predicting x0_prev pays (measured 0.056 vs 0.084 at 15 steps)


def test_mixed_solvers_share_denoiser_calls_and_match_single_runs(pipeline: LDLMPipeline) -> None:
    """Every solver in one continuous batch, at different steps (staggered step counts and a late
    arrival), each keeping its own past: each answer equals its request's single run, token for token."""
    requests = [
        GenerateRequest(n=2 if i % 2 else 1, length=8, steps=3 + 2 * i, seed=40 + i, sampler=name) for i, name in enumerate(SAMPLERS)
    ]
    # a second request of each multistep solver, on another grid: samples of one solver at different
    # times in one call, each with its own past (log-SNR and x0_hat)
    requests += [GenerateRequest(n=1, length=8, steps=4, seed=60 + i, sampler=name) for i, name in enumerate(("dpm2m", "dpm3m"))]
    sizes: list[int] = []
    scheduler = GenerationScheduler(pipeline, max_batch=4, start=False, observer=lambda b, q, c: sizes.append(b))
    try:
        futures = [scheduler.submit(r) for r in requests]
        scheduler.start()
        results = [f.result(timeout=120) for f in futures]
    finally:
        scheduler.close(timeout_s=30)
    assert max(sizes) == 4  # samples of different solvers did share calls
    for request, result in zip(requests, results):
        alone = pipeline.generate(request.n, request.length, request.steps, request.seed, request.sampler)
        assert torch.equal(result.token_ids, alone.token_ids), request


def inpainted_by_hand(pipeline: LDLMPipeline, z: torch.Tensor, length: int, seed: int, steps: int, sampler: str) -> torch.Tensor:
    """Prefix inpainting under a multistep solver, written out: at every step the prompt's positions are
    reset to its latents z forward-noised to that step's time, then one step of the solver, which keeps
    its own past and self-conditioning input."""
    from ldlm.sampling import NoiseStream, sample_seeds

    model, schedule, solver = pipeline.graphs, pipeline.schedule, get_sampler(sampler)
    p, d = z.shape[0], pipeline.config.d_model
    sample_seed = sample_seeds(seed, 1)[0]
    x = NoiseStream(sample_seed, (length, d)).draw()[None]
    prefix_noise = NoiseStream(sample_seed ^ 1, (p, d))
    x0_prev = torch.zeros_like(x)
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    x_prev = torch.zeros_like(x)
    grid = solver.time_grid(steps, pipeline.config.t_min, schedule).float()
    mask = torch.ones(1, length, dtype=torch.bool)
    with torch.no_grad():
        for i in range(steps):
            t, t_next = grid[i].reshape(1), grid[i + 1].reshape(1)
            x[0, :p] = schedule.alpha(t) * z + schedule.sigma(t) * prefix_noise.draw()
            x0_hat = model.denoise(x, t, x0_prev, mask)
            if solver.corrector and i > 0:  # redo the last step with this x0_hat
                x = solver.correct(schedule, x, x_prev, x0_hat, grid[i - 1].reshape(1), t, past)
            x_prev = x
            result = solver.step(schedule, x, x0_hat, t, t_next, past)
            x, x0_prev = result.x, result.x0_prev
            past = [(x0_hat, schedule.log_snr(t)), *past][: solver.history]
        x[0, :p] = z
        return model.decode_tokens(x, mask)[0]


@pytest.mark.parametrize("sampler", ["dpm2m", "dpm3m-psc", "dpm3m-psc-unic"])
def test_prefix_inpainting_under_a_multistep_solver(pipeline: LDLMPipeline, sampler: str) -> None:
    z = pipeline.encode(["The weather today is"]).latents[0]
    length, steps = z.shape[0] + 7, 9
    scheduler = GenerationScheduler(pipeline, max_batch=4)
    try:
        other = scheduler.submit(GenerateRequest(n=2, length=length, steps=5, seed=8, sampler="ddim"))  # shares the calls
        result = scheduler.submit(GenerateRequest(n=1, length=length, steps=steps, seed=5, sampler=sampler), prefix=z).result(60)
        other.result(60)
    finally:
        scheduler.close(timeout_s=30)
    expected = inpainted_by_hand(pipeline, z, length, 5, steps, sampler)
    assert torch.equal(result.token_ids[0], expected)


def test_config_default_sampler_is_checked() -> None:
    from ldlm.model.config import LDLMConfig

    with pytest.raises(ValueError, match="default_sampler='euler' is invalid; allowed: sde, ddim, dpm2m, dpm3m, dpm3m-psc, dpm3m-psc-unic"):
        LDLMConfig(default_sampler="euler")
    assert LDLMConfig().default_sampler in SAMPLERS_BY_NAME


def test_onnx_runtime_gives_the_eager_tokens_under_every_solver(pipeline: LDLMPipeline, export_dir) -> None:
    """Parity under the new solvers: the exported graphs on ONNX Runtime fp32, sampled from the same CPU
    noise, decode to exactly the eager pipeline's tokens (what `ldlm parity --sampler` requires)."""
    pytest.importorskip("onnxruntime", reason="the ONNX Runtime side of parity (pip install -e .[cpu])")
    from ldlm.serve.runtime.backends import BackendGraphs, open_graphs

    graphs, config, tokenizer = open_graphs("ort", export_dir)
    ort = LDLMPipeline(BackendGraphs(graphs), tokenizer, config=config)
    for sampler in ("dpm2m", "dpm3m-psc", "dpm3m-psc-unic"):
        expected = pipeline.generate(3, 16, 12, seed=9, sampler=sampler).token_ids
        assert torch.equal(ort.generate(3, 16, 12, seed=9, sampler=sampler).token_ids, expected), sampler
