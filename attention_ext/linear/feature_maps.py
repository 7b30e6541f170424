"""Feature maps phi of linear attention, by name, user-extensible.

    elu, relu, identity   elementwise; fused in the kernel (the op's feature_map codes 1, 2, 0)
    favor                 Performer's FAVOR+ positive orthogonal random features (Choromanski et al.)
    rfa                   random Fourier features, sin / cos (Peng et al. 2021)

A feature map takes (..., D) and returns (..., M). `linear_attention(feature_map=...)` accepts a
registered name, a FeatureMap, or any nn.Module / callable: everything without a fused code is
applied in PyTorch before the kernel, which then runs its identity map on features of width M.
`register_feature_map(name, factory)` adds a name; `factory(head_dim, **kwargs)` builds the map.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from . import reference

__all__ = ["FeatureMap", "ElementwiseFeatureMap", "RandomFeatureMap", "Favor", "RFA", "FEATURE_MAPS",
           "register_feature_map", "get_feature_map", "resolve"]


class FeatureMap(nn.Module):
    """phi: (..., D) -> (..., out_dim(D)).

    `fused_code` is the op's feature_map code when the kernel applies this map itself (the
    functional layer then passes q and k unmapped), None otherwise. `forward(x, is_query,
    normalized)`: a query under normalization (normalized=True) may come back scaled by any
    positive per-row constant, which cancels in out_i = O'_i / den_i; random maps use that
    freedom for numerical stability."""

    fused_code: Optional[int] = None

    def out_dim(self, d: int) -> int:
        return d

    def prepare(self) -> None:
        """Called once per attention call, before q and k are mapped (training-time redraws)."""

    def forward(self, x: Tensor, *, is_query: bool = False, normalized: bool = True) -> Tensor:
        raise NotImplementedError


class ElementwiseFeatureMap(FeatureMap):
    """The fused maps: phi = reference.phi(., code) (0 identity, 1 elu + 1, 2 relu)."""

    def __init__(self, code: int):
        super().__init__()
        self.fused_code = code

    def forward(self, x: Tensor, *, is_query: bool = False, normalized: bool = True) -> Tensor:
        return reference.phi(x, self.fused_code)

    def extra_repr(self) -> str:
        return reference.FUSED_FEATURE_MAPS[self.fused_code]


def default_nb_features(d: int) -> int:
    """Performer's default number of random features: ceil(d ln d) (at least 1)."""
    return max(1, math.ceil(d * math.log(d))) if d > 1 else 1


def gaussian_projection(m: int, d: int, *, orthogonal: bool, generator: torch.Generator) -> Tensor:
    """(m, d) float32 rows w_r ~ N(0, I_d). Orthogonal: blocks of d exactly orthogonal rows (QR of
    a Gaussian matrix), each row rescaled to the norm of an independent Gaussian vector, so every
    row keeps the N(0, I_d) marginal (Performer's orthogonal random features)."""
    # drawn where the generator lives (the CPU without one), also under a `with torch.device("cuda")`
    dev = generator.device if generator is not None else torch.device("cpu")
    if not orthogonal:
        return torch.randn(m, d, generator=generator, device=dev)
    blocks = []
    for _ in range(-(-m // d)):
        qmat, r = torch.linalg.qr(torch.randn(d, d, generator=generator, device=dev))
        qmat = qmat * torch.sign(torch.diagonal(r)).unsqueeze(0)  # the sign fix that makes Q Haar-distributed
        blocks.append(qmat.T)  # (d, d), orthonormal rows
    w = torch.cat(blocks, 0)[:m]  # (m, d)
    norms = torch.randn(m, d, generator=generator, device=dev).norm(dim=1, keepdim=True)  # chi_d distributed
    return w * norms


class RandomFeatureMap(FeatureMap):
    """A map built on an (m, d) Gaussian projection: a buffer, or a Parameter with
    learnable=True. `redraw(seed)` draws a new one (from the seed, else the map's own generator,
    itself seeded from `seed` or torch's global RNG at construction). With redraw_interval=N the
    projection is redrawn every N attention calls in training mode (prepare())."""

    def __init__(self, head_dim: int, nb_features: Optional[int] = None, *, orthogonal: bool = True,
                 seed: Optional[int] = None, redraw_interval: Optional[int] = None, learnable: bool = False):
        super().__init__()
        self.head_dim = head_dim
        self.nb_features = nb_features or default_nb_features(head_dim)
        self.orthogonal = orthogonal
        self.redraw_interval = redraw_interval
        self.learnable = learnable
        self._generator = torch.Generator()
        self._generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()) if seed is None else seed)
        self._calls = 0
        w = gaussian_projection(self.nb_features, head_dim, orthogonal=orthogonal, generator=self._generator)
        if learnable:
            self.projection = nn.Parameter(w)
        else:
            self.register_buffer("projection", w)  # (m, d)

    @torch.no_grad()
    def redraw(self, seed: Optional[int] = None) -> None:
        if seed is not None:
            self._generator.manual_seed(seed)
        w = gaussian_projection(self.nb_features, self.head_dim, orthogonal=self.orthogonal, generator=self._generator)
        self.projection.copy_(w)

    def prepare(self) -> None:
        if self.training and self.redraw_interval:
            if self._calls and self._calls % self.redraw_interval == 0:
                self.redraw()
            self._calls += 1

    def _project(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        """x (..., d) -> (x in the compute dtype, x @ W^T (..., m), W (m, d)); float32 compute
        (float64 for float64 x)."""
        acc = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(acc)
        w = self.projection.to(device=x.device, dtype=acc)
        return xf, xf @ w.T, w

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, nb_features={self.nb_features}, orthogonal={self.orthogonal}, "
                f"redraw_interval={self.redraw_interval}, learnable={self.learnable}")


class Favor(RandomFeatureMap):
    """FAVOR+ positive random features (Performer): with x scaled by d^(-1/4),

        phi(x)_r = exp(w_r . x - |x|^2 / 2) / sqrt(m),     E[phi(q) . phi(k)] = exp(q . k / sqrt(d))

    so normalized linear attention estimates softmax attention with scale 1 / sqrt(d)
    (exactly unbiased for the kernel; the ratio's bias falls as O(1/m)).

    Stabilized (default) by constants that cancel in out_i = O'_i / den_i (so only with
    normalized=True): a query subtracts its row maximum from its exponents; keys are mapped in the
    log domain (`log_domain`, `exponents()`) and the functional layer subtracts one constant per
    (batch, kv head), the running maximum, carried in LinearAttentionState.log_scale so that
    states stay consistent across calls and steps (the online-softmax rescaling). The functional
    layer scales eps by the same offsets (linear.functional.normalize_offset), so the result is
    the unstabilized definition phi(q)^T S / (phi(q)^T z + eps), whatever the call splits; the
    offsets keep every feature and sum finite.
    """

    log_domain = True

    def out_dim(self, d: int) -> int:
        return self.nb_features

    def __init__(self, head_dim: int, nb_features: Optional[int] = None, *, stabilize: bool = True, **kwargs):
        super().__init__(head_dim, nb_features, **kwargs)
        self.stabilize = stabilize

    def exponents(self, x: Tensor) -> Tensor:
        """log(phi(x) sqrt(m)) = w_r . x - |x|^2 / 2 (x scaled by d^(-1/4)), (..., m) in float32
        (float64 for float64 x)."""
        a = x.shape[-1] ** -0.25  # the data normalizer: phi(q) . phi(k) estimates exp(q . k / sqrt(d))
        xf, proj, _ = self._project(x)  # proj (..., m)
        return a * proj - (0.5 * a * a) * (xf * xf).sum(-1, keepdim=True)

    def features(self, e: Tensor, dtype: torch.dtype) -> Tensor:
        """exp(e) / sqrt(m) in `dtype`."""
        return (e.exp() * self.nb_features ** -0.5).to(dtype)

    def forward(self, x: Tensor, *, is_query: bool = False, normalized: bool = True) -> Tensor:
        e = self.exponents(x)
        if self.stabilize and is_query and normalized:
            e = e - e.amax(-1, keepdim=True).detach()
        return self.features(e, x.dtype)


class RFA(RandomFeatureMap):
    """Random Fourier features (RFA): with x normalized to unit length (normalize_input),

        phi(x) = [sin(W x / sigma), cos(W x / sigma)] / sqrt(m)          (..., 2m)
        E[phi(q) . phi(k)] = exp(-|q - k|^2 / (2 sigma^2)) = exp((q . k - 1) / sigma^2)

    i.e. softmax attention with temperature sigma^2 over unit-norm q, k. Features may be
    negative, so the normalizer can approach 0 (eps guards it)."""

    def __init__(self, head_dim: int, nb_features: Optional[int] = None, *, sigma: float = 1.0,
                 normalize_input: bool = True, **kwargs):
        super().__init__(head_dim, nb_features, **kwargs)
        self.sigma = sigma
        self.normalize_input = normalize_input

    def out_dim(self, d: int) -> int:
        return 2 * self.nb_features

    def forward(self, x: Tensor, *, is_query: bool = False, normalized: bool = True) -> Tensor:
        if self.normalize_input:
            x = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        _, proj, _ = self._project(x)
        proj = proj / self.sigma
        return (torch.cat([proj.sin(), proj.cos()], -1) * self.nb_features ** -0.5).to(x.dtype)


# ---------------------------------------------------------------------------------- registry
# a map as applied: a FeatureMap, or any nn.Module / callable (..., D) -> (..., M)
FeatureMapLike = Union[FeatureMap, Callable[[Tensor], Tensor]]
# what linear_attention(feature_map=...) takes: a registered name or a map
FeatureMapSpec = Union[str, FeatureMapLike]

FEATURE_MAPS: Dict[str, Callable[..., FeatureMapLike]] = {}


def register_feature_map(name: str, factory: Optional[Callable[..., FeatureMapLike]] = None) -> Callable:
    """Register `factory(head_dim, **kwargs) -> feature map` under `name`; usable as a decorator."""
    def deco(f):
        FEATURE_MAPS[name] = f
        return f
    return deco(factory) if factory is not None else deco


register_feature_map("identity", lambda head_dim=None: ElementwiseFeatureMap(0))
register_feature_map("elu", lambda head_dim=None: ElementwiseFeatureMap(1))
register_feature_map("relu", lambda head_dim=None: ElementwiseFeatureMap(2))
register_feature_map("favor", Favor)
register_feature_map("rfa", RFA)


def get_feature_map(name: str, head_dim: Optional[int] = None, **kwargs: Any) -> FeatureMapLike:
    """A new feature map from the registry: FEATURE_MAPS[name](head_dim, **kwargs)."""
    if name not in FEATURE_MAPS:
        raise ValueError(f"unknown feature_map {name!r}; registered: {sorted(FEATURE_MAPS)}")
    return FEATURE_MAPS[name](head_dim, **kwargs)


# maps built from a bare name, kept so that repeated calls use one projection (seed 0)
_BY_NAME: Dict[Tuple[str, Optional[int]], Union[FeatureMap, Callable]] = {}


def resolve(spec: FeatureMapSpec, head_dim: int) -> FeatureMapLike:
    """What linear_attention(feature_map=spec) applies: a name gives the registered map for this
    head dim (built once per (name, head_dim); random maps get seed 0), anything else is used
    as given (a FeatureMap, an nn.Module or a callable)."""
    if isinstance(spec, str):
        key = (spec, head_dim)
        fm = _BY_NAME.get(key)
        if fm is None:
            if spec not in FEATURE_MAPS:
                raise ValueError(f"unknown feature_map {spec!r}; registered: {sorted(FEATURE_MAPS)}")
            f = FEATURE_MAPS[spec]
            fm = f(head_dim, seed=0) if isinstance(f, type) and issubclass(f, RandomFeatureMap) else f(head_dim)
            _BY_NAME[key] = fm
        return fm
    if not callable(spec):
        raise TypeError(f"feature_map must be a name, a FeatureMap, an nn.Module or a callable, "
                        f"got {type(spec).__name__}")
    return spec


def apply(fm: FeatureMapLike, x: Tensor, *, is_query: bool, normalized: bool) -> Tensor:
    """phi(x) by a resolved map: FeatureMaps get the query / normalization hints, other
    callables just x."""
    if isinstance(fm, FeatureMap):
        return fm(x, is_query=is_query, normalized=normalized)
    return fm(x)
