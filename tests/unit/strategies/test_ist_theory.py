# ruff: noqa: RUF003  (the paper's notation: −, γ, ×, reads better than ASCII here)
"""Shulgin & Richtárik (arXiv 2306.16484) on quadratics: the three results the simulator must reproduce."""

from __future__ import annotations

import numpy as np
import pytest

from ravnest_p2p.strategies.ist_theory import (
    QuadraticProblem,
    descent_matrix,
    fixed_point_scaled,
    make_problem,
    perm_sketch,
    run_ist,
    scaled_sketch,
    two_by_two_counterexample,
)


def test_perm_sketch_is_a_partition_with_perfect_reconstruction():
    problem = make_problem(64, 16, seed=0)
    diag = perm_sketch(problem, np.random.default_rng(0))
    assert diag.shape == (16, 64)
    assert np.array_equal((diag > 0).sum(axis=0), np.ones(64))  # each coordinate to exactly one client
    np.testing.assert_allclose(diag.mean(axis=0), np.ones(64))  # (1/n) Σ C_i = I


@pytest.mark.parametrize(("a", "b", "c"), [(1.0, 100.0, 9.0), (1.0, 4.0, 1.9)])
def test_i_plain_perm_sketch_has_no_expected_descent_on_the_2x2_example(a, b, c):
    assert c > 2 * a * b / (a + b)  # the paper's condition for an indefinite W̄
    problem = two_by_two_counterexample(a, b, c)
    sketch = perm_sketch(problem, np.random.default_rng(0))
    w_bar = descent_matrix(problem, sketch)
    # Perm-1 with d = n deals every coordinate, so W̄ is the same for every permutation: the expectation
    for other in range(1, 5):
        np.testing.assert_allclose(
            descent_matrix(problem, perm_sketch(problem, np.random.default_rng(other))), w_bar
        )
    np.testing.assert_allclose(np.linalg.det(w_bar), 4 * a * a * b * b - c * c * (a + b) ** 2)
    eigvals, eigvecs = np.linalg.eigh(w_bar)
    assert eigvals[0] < 0
    x0 = eigvecs[:, 0]
    for gamma in np.geomspace(1e-4, 1.0 / (2 * max(a, b)), 12):
        trace = run_ist(problem, x0, sketch=perm_sketch, step_size=float(gamma), num_rounds=1, seed=3)
        assert trace.loss[1] > trace.loss[0]  # the step goes uphill, whatever its size
    # the preconditioned (unit-diagonal) version of the same matrix has W̄ ⪰ 0: descent is restored
    d_inv = 1 / np.sqrt(np.diag(problem.L_mean))
    pre = problem.L_mean * np.outer(d_inv, d_inv)
    fixed = QuadraticProblem(L=np.stack([pre, pre]), b=np.zeros((2, 2)))
    assert np.linalg.eigvalsh(descent_matrix(fixed, perm_sketch(fixed, np.random.default_rng(0))))[0] >= 0


def test_ii_preconditioned_homogeneous_interpolation_converges_at_gd_rate():
    n, d = 8, 256
    problem = make_problem(d, n, seed=1, homogeneous=True, interpolation=True, unit_diagonal=True)
    eig = np.linalg.eigvalsh(problem.L_mean)
    mu, big_l = eig[0], eig[-1]
    x0 = np.random.default_rng(2).standard_normal(d)
    rounds = 60
    trace = run_ist(problem, x0, sketch=perm_sketch, step_size=1 / (n * big_l), num_rounds=rounds, seed=4)
    assert np.all(np.diff(trace.loss) < 0)
    # GD with step 1/L contracts ‖x − x*‖ by (1 − μ/L) per step; IST keeps (at least half of) that rate
    gd_bound = (1 - mu / (2 * big_l)) ** rounds
    assert np.linalg.norm(trace.x[-1]) <= gd_bound * np.linalg.norm(x0)


def test_ii_scaled_sketch_converges_in_one_step_in_heterogeneous_interpolation():
    n = 16
    problem = make_problem(n, n, seed=5, homogeneous=False, interpolation=True, cond=50.0)
    x0 = np.random.default_rng(6).standard_normal(n)
    trace = run_ist(problem, x0, sketch=scaled_sketch, step_size=1.0, num_rounds=3, seed=7)
    assert np.linalg.norm(trace.x[1]) < 1e-12 * np.linalg.norm(x0)
    # and the plain Perm-1 sketch on the same heterogeneous problem does not (it still moves at round 3)
    plain = run_ist(problem, x0, sketch=perm_sketch, step_size=1.0 / (n * 50.0), num_rounds=3, seed=7)
    assert np.linalg.norm(plain.x[-1]) > 1e-3 * np.linalg.norm(x0)


def test_iii_general_case_plateaus_at_the_closed_form_fixed_point_even_with_step_decay():
    n = 16
    problem = make_problem(n, n, seed=8, homogeneous=False, interpolation=False, cond=20.0)
    x_star, x_inf = problem.solution(), fixed_point_scaled(problem)
    bias = np.linalg.norm(x_inf - x_star)
    assert bias > 0.1 * np.linalg.norm(x_star)  # x^∞ ≠ x*
    x0 = np.zeros(n)
    constant = run_ist(problem, x0, sketch=scaled_sketch, step_size=0.5, num_rounds=1000, seed=9)
    decayed = run_ist(
        problem, x0, sketch=scaled_sketch, step_size=lambda k: 1 / (k + 1), num_rounds=3000, seed=9
    )
    # constant step: the iterates fluctuate around x^∞ (their mean is x^∞); decay kills the noise ...
    assert np.linalg.norm(constant.x[100:].mean(axis=0) - x_inf) < 0.35 * bias
    assert np.linalg.norm(decayed.x[-1] - x_inf) < 0.25 * bias
    # ... but not the bias: the distance to x* and the gradient norm stay at the plateau
    for trace in (constant, decayed):
        assert np.linalg.norm(trace.x[-1] - x_star) > 0.8 * bias
        assert trace.grad_sq[-1] > 0.5 * float(np.sum(problem.grad(x_inf) ** 2))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of n"):
        perm_sketch(make_problem(10, 4, seed=0), np.random.default_rng(0))
    with pytest.raises(ValueError, match="d == n"):
        scaled_sketch(make_problem(8, 4, seed=0), np.random.default_rng(0))
    with pytest.raises(ValueError, match="positive definite"):
        two_by_two_counterexample(1.0, 1.0, 2.0)
