# ruff: noqa: RUF002, RUF003  (the paper's notation: −, γ, ×, reads better than ASCII here)
"""A quadratic simulator of Independent Subnetwork Training (pure numpy: no torch, no network).

Problem. IST (Yuan et al., arXiv 1910.02120) deals the hidden units of a network to n workers, lets each
train its piece, and copies the pieces back. Before wiring it to the transport we want to know what the
method can and cannot promise. Shulgin & Richtárik ("Towards a Better Theoretical Understanding of
Independent Subnetwork Training", arXiv 2306.16484) analyse it on quadratics, where everything is exact.

Model. Client i holds f_i(x) = ½ xᵀ L_i x − b_iᵀ x; f = mean f_i. Each round draws a random permutation π
of the d = q·n coordinates and gives client i the diagonal sketch C_i that keeps block i of π (Perm-q).
One round with one local step and exact gradients is

    x⁺ = x − γ · (1/n) Σ_i C_i ∇f_i(C_i x)                                                  (*)

For the plain permutation sketch C_i = n·Σ_{j∈block i} e_j e_jᵀ (the factor n is IST's output scaling,
(1/n)Σ C_i = I) this is exactly "sub-model step, then average the sub-models". The paper's key point:
∇f(Cx) is a *biased* estimate of ∇f(x), unlike compressed gradients C∇f(x).

What this module reproduces (tests in tests/unit/strategies/test_ist_theory.py):
  (i)   no expected descent: on the homogeneous 2×2 example L = [[a, c], [c, b]] with
        c > 2ab/(a+b), W̄ = ½E[L B̄ + B̄ L] (B̄ = (1/n)Σ C_i L C_i) is indefinite, and along its negative
        eigenvector every step size increases f;
  (ii)  interpolation (b_i = 0): with a unit-diagonal (Jacobi-preconditioned) homogeneous L, or the
        per-client scaled sketch C̃_i = √n·[L_i]_{jj}^{-1/2} e_j e_jᵀ (heterogeneous, d = n), the iterates
        converge linearly (one step at γ = 1 for the scaled sketch);
  (iii) general case (b_i ≠ 0, scaled sketch, d = n): E[x^k] → x^∞ = (1/(n√n)) Σ_i D_i^{-1/2} b_i, which
        differs from x* = L̄^{-1} b̄; decaying γ removes the noise around x^∞ but not the bias.

Alternatives rejected. Simulating the neural network itself for these claims: the effects are drowned
in SGD noise and the closed forms are lost. Monte-Carlo estimates of W̄: for the sketches used here B̄
does not depend on π (every coordinate is dealt to exactly one client), so W̄ is computed exactly.

Known limits. One local step and exact gradients, as in the paper's theorems; the real IST takes K
local SGD steps. The scaled sketch and the x^∞ closed form are for Perm-1 (d = n), as stated in the
paper; the simulator runs Perm-q for any d = q·n (d up to 1024, n up to 16 in the tests and plot).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "QuadraticProblem",
    "descent_matrix",
    "fixed_point_scaled",
    "make_problem",
    "perm_sketch",
    "run_ist",
    "scaled_sketch",
    "two_by_two_counterexample",
]

Array = NDArray[np.float64]
SketchFn = Callable[["QuadraticProblem", np.random.Generator], Array]


@dataclasses.dataclass(frozen=True)
class QuadraticProblem:
    """n clients' quadratics f_i(x) = ½ xᵀ L_i x − b_iᵀ x over R^d.

    Attributes:
        L: shape (n, d, d), each symmetric positive definite.
        b: shape (n, d); all zeros is the interpolation case.
    """

    L: Array
    b: Array

    def __post_init__(self) -> None:
        if self.L.ndim != 3 or self.L.shape[1] != self.L.shape[2]:
            raise ValueError(f"L must have shape (n, d, d), got {self.L.shape}")
        if self.b.shape != self.L.shape[:2]:
            raise ValueError(f"b must have shape {self.L.shape[:2]}, got {self.b.shape}")

    @property
    def num_clients(self) -> int:
        return int(self.L.shape[0])

    @property
    def dim(self) -> int:
        return int(self.L.shape[1])

    @property
    def L_mean(self) -> Array:
        return np.asarray(self.L.mean(axis=0))

    @property
    def b_mean(self) -> Array:
        return np.asarray(self.b.mean(axis=0))

    def loss(self, x: Array) -> float:
        """f(x) = mean_i f_i(x)."""
        return float(0.5 * x @ self.L_mean @ x - self.b_mean @ x)

    def grad(self, x: Array) -> Array:
        """∇f(x) = L̄x − b̄."""
        return np.asarray(self.L_mean @ x - self.b_mean)

    def solution(self) -> Array:
        """x* = L̄^{-1} b̄."""
        return np.asarray(np.linalg.solve(self.L_mean, self.b_mean))


def _random_spd(d: int, rng: np.random.Generator, *, cond: float) -> Array:
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    eig = np.geomspace(1.0, cond, d)
    return np.asarray((q * eig) @ q.T)


def make_problem(
    d: int,
    n: int,
    *,
    seed: int,
    homogeneous: bool = True,
    interpolation: bool = True,
    cond: float = 10.0,
    unit_diagonal: bool = False,
) -> QuadraticProblem:
    """A random problem: SPD L_i with condition number ``cond``, b_i standard normal (or zero).

    Args:
        d: dimension (a multiple of ``n`` for the Perm-q sketch).
        n: number of clients.
        seed: RNG seed.
        homogeneous: all clients share one L (their b_i still differ unless ``interpolation``).
        interpolation: b_i = 0 for every client, so x* = 0 solves every f_i.
        cond: condition number of each L_i.
        unit_diagonal: Jacobi-precondition each L_i to D^{-1/2} L D^{-1/2} (the paper's homogeneous fix).
    """
    if d < 1 or n < 1:
        raise ValueError(f"need d >= 1 and n >= 1, got d={d}, n={n}")
    rng = np.random.default_rng(seed)
    base = _random_spd(d, rng, cond=cond)
    mats = [base if homogeneous else _random_spd(d, rng, cond=cond) for _ in range(n)]
    if unit_diagonal:
        mats = [m / np.sqrt(np.outer(np.diag(m), np.diag(m))) for m in mats]
    b = np.zeros((n, d)) if interpolation else rng.standard_normal((n, d))
    return QuadraticProblem(L=np.stack(mats), b=b)


def two_by_two_counterexample(a: float = 1.0, b: float = 100.0, c: float = 9.0) -> QuadraticProblem:
    """The paper's homogeneous 2×2 example, two clients, interpolation: L = [[a, c], [c, b]].

    Raises:
        ValueError: if L is not positive definite.
    """
    if not (a > 0 and b > 0 and c * c < a * b):
        raise ValueError("L = [[a, c], [c, b]] must be positive definite (a, b > 0, c² < ab)")
    mat = np.array([[a, c], [c, b]])
    return QuadraticProblem(L=np.stack([mat, mat]), b=np.zeros((2, 2)))


def perm_sketch(problem: QuadraticProblem, rng: np.random.Generator) -> Array:
    """Diagonals of the Perm-q sketches, shape (n, d): C_i = n·Σ_{j∈block i of π} e_j e_jᵀ.

    Raises:
        ValueError: if d is not a multiple of n.
    """
    n, d = problem.num_clients, problem.dim
    if d % n:
        raise ValueError(f"Perm-q needs d to be a multiple of n (d={d}, n={n})")
    perm = rng.permutation(d)
    diag = np.zeros((n, d))
    for i, block in enumerate(np.split(perm, n)):
        diag[i, block] = n
    return diag


def scaled_sketch(problem: QuadraticProblem, rng: np.random.Generator) -> Array:
    """Diagonals of the per-client scaled Perm-1 sketch: C̃_i = √n·[L_i]_{jj}^{-1/2} e_j e_jᵀ, j = π_i.

    With it B̄ = (1/n)Σ C̃_i L_i C̃_i = I for every π (heterogeneous fix of the paper).

    Raises:
        ValueError: if d != n.
    """
    n, d = problem.num_clients, problem.dim
    if d != n:
        raise ValueError(f"the scaled sketch is Perm-1: needs d == n (d={d}, n={n})")
    perm = rng.permutation(d)
    diag = np.zeros((n, d))
    for i in range(n):
        j = perm[i]
        diag[i, j] = np.sqrt(n) / np.sqrt(problem.L[i, j, j])
    return diag


def _estimator(problem: QuadraticProblem, sketch: Array, x: Array) -> Array:
    """(1/n) Σ_i C_i ∇f_i(C_i x) for diagonal sketches."""
    out = np.zeros_like(x)
    for i in range(problem.num_clients):
        c = sketch[i]
        out += c * (problem.L[i] @ (c * x) - problem.b[i])
    return out / problem.num_clients


def descent_matrix(problem: QuadraticProblem, sketch: Array) -> Array:
    """W̄ = ½(L̄ B̄ + B̄ L̄) with B̄ = (1/n)Σ C_i L_i C_i, for one draw of the sketch.

    For Perm-1 and the scaled sketch B̄ does not depend on π, so this is the expectation in Theorem 1.
    """
    n = problem.num_clients
    b_bar = sum(np.outer(sketch[i], sketch[i]) * problem.L[i] for i in range(n)) / n
    lbar = problem.L_mean
    return np.asarray(0.5 * (lbar @ b_bar + b_bar @ lbar))


def fixed_point_scaled(problem: QuadraticProblem) -> Array:
    """x^∞ = (1/(n√n)) Σ_i D_i^{-1/2} b_i, the limit of E[x^k] under the scaled sketch (D_i = Diag L_i)."""
    n = problem.num_clients
    diag = np.diagonal(problem.L, axis1=1, axis2=2)
    return np.asarray((problem.b / np.sqrt(diag)).sum(axis=0) / (n * np.sqrt(n)))


@dataclasses.dataclass(frozen=True)
class IstTrace:
    """Iterates of `run_ist`: ``x[k]`` is x^k (k = 0..K), ``loss[k]`` f(x^k), ``grad_sq[k]`` ‖∇f(x^k)‖²."""

    x: Array
    loss: Array
    grad_sq: Array


def run_ist(
    problem: QuadraticProblem,
    x0: Array,
    *,
    sketch: SketchFn,
    step_size: Callable[[int], float] | float,
    num_rounds: int,
    seed: int,
) -> IstTrace:
    """Run (*) for ``num_rounds`` rounds, a fresh sketch each round.

    Args:
        problem: the clients' quadratics.
        x0: starting point, shape (d,).
        sketch: `perm_sketch`, `scaled_sketch` or any function (problem, rng) -> (n, d) diagonals.
        step_size: γ, or a function of the round index k returning γ_k.
        num_rounds: K.
        seed: seed of the sketches' RNG.
    """
    rng = np.random.default_rng(seed)
    xs = [np.asarray(x0, dtype=np.float64).copy()]
    for k in range(num_rounds):
        gamma = step_size(k) if callable(step_size) else step_size
        xs.append(xs[-1] - gamma * _estimator(problem, sketch(problem, rng), xs[-1]))
    stacked = np.stack(xs)
    losses = np.array([problem.loss(x) for x in stacked])
    grads = np.array([float(np.sum(problem.grad(x) ** 2)) for x in stacked])
    return IstTrace(x=stacked, loss=losses, grad_sq=grads)
