"""Native CPU kernels for compressed optimizer moments, built with the system's C compiler on first use and loaded
through ctypes: quantize.c (the conversions), adam.c (the whole update in one pass), codes.h (what both share).

Why: the quantisers of runtime/quantize.py are about 40 torch ops a block, each a pass over the block with a parallel
region of its own, which made the CPU worker's compressed update 3.5x (bf16) to 7x (int8) slower than the exact one.
quantize.c does each conversion in one pass, with the same operations in the same order, so the codes and values are
bit for bit those of the torch ops (tests/unit/test_native.py), which remain the route on the GPU and wherever no
compiler is found. adam.c reads a block's gradient and codes, updates the fp32 parameter (or master), writes the
half-precision parameter and the new codes, with no scratch: fewer bytes than an exact update moves.

The build: `$CC` (else `cc`) with -O3 -march=native -fopenmp -ffp-contract=off (and no errno or FP traps,
which lets the loops vectorise without changing a result) into a shared library named by a hash
of the source, the flags and this machine's processor, under `$PSTAR_FX_CACHE` (else `$XDG_CACHE_HOME/pstar_fx`,
else `~/.cache/pstar_fx`), a directory only its owner may write (anything else is not loaded from: a library there
would run in this process); a failed build or load leaves `kernels()` None and `why_not()` saying why, and the torch
ops serve. The library, once loaded, is kept for the process (a cache of a read-only thing, like torch's own
extension loading).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

_HERE = Path(__file__).parent
_SOURCES = [_HERE / "quantize.c", _HERE / "adam.c"]
_HEADERS = [_HERE / "codes.h"]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC",
          "-shared", "-std=c99"]
_F, _I64, _I32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_int


class AdamArgs(ctypes.Structure):
    """adam.c's `struct adam`: the update's scalars, each computed in double and rounded to fp32 once."""
    _fields_ = [(name, ctypes.c_float) for name in ("decay", "weight_decay", "w1", "beta2", "w2", "eps", "step_size",
                                                    "bc2_sqrt", "inv_scale", "coef")] + \
               [(name, ctypes.c_int32) for name in ("decoupled", "maximize", "grad_kind", "out_kind")]


_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_A = ctypes.POINTER(AdamArgs)
_SIGNATURES = {
    "pstar_quant_bf16": [_F, _F, _F, _F, _I64, _I32, _I32, _INT],
    "pstar_quant_int8": [_F, _F, _F, _F, _F, _F, _I64, _I32, _I32, _INT],
    "pstar_dequant_int8": [_F, _F, _F, _F, _F, _F, _I64, _INT],
    "pstar_adam_bf16": [_A, _F, _F, _F, _F, _F, _I64, _I32, _I32, _INT],
    "pstar_adam_int8": [_A, _F, _F, _F, _F, _F, _F, _F, _I64, _I32, _I32, _INT],
    "pstar_adam_exact": [_A, _F, _F, _F, _F, _F, _I64, _INT],
    "pstar_has_fp16": [],
}


@dataclass(frozen=True)
class Kernels:
    """The loaded library's functions, on contiguous CPU tensors (shapes and dtypes checked by the caller:
    runtime/quantize.py). first: the chunk element of element 0; seed: quantize.seed's value; element 0 starts an
    int8 block."""
    lib: ctypes.CDLL
    fp16: bool          # the update takes fp16 gradients and parameters (the compiler had _Float16)
    # kinds of exact update (reproduces_torch's key) -> whether adam_exact computes them as torch's kernel does
    verified: dict = field(default_factory=dict, compare=False, repr=False)

    def takes(self, *tensors) -> bool:
        """The update takes these tensors' dtypes (None: absent)."""
        return all(t is None or t.dtype in (torch.float32, torch.bfloat16) or (t.dtype == torch.float16 and self.fp16)
                   for t in tensors)

    def quant_bf16(self, m, v, qm, qv, first: int, seed: int) -> None:
        self.lib.pstar_quant_bf16(_p(m), _p(v), _p(qm), _p(qv), m.numel(), first, seed, torch.get_num_threads())

    def quant_int8(self, m, v, qm, qv, sm, sv, first: int, seed: int) -> None:
        self.lib.pstar_quant_int8(_p(m), _p(v), _p(qm), _p(qv), _p(sm), _p(sv), m.numel(), first, seed,
                                  torch.get_num_threads())

    def dequant_int8(self, qm, qv, sm, sv, m, v) -> None:
        self.lib.pstar_dequant_int8(_p(qm), _p(qv), _p(sm), _p(sv), _p(m), _p(v), m.numel(),
                                    torch.get_num_threads())

    def adam(self, cfg, step: float, p32, out, grad, parts: dict, first: int, seed: int, *, inv_scale: float = 1.0,
             coef: float = 1.0) -> None:
        """One Adam / AdamW update (cfg: optim.AdamConfig; step: the count after it) of the fp32 parameter or
        master p32 with the gradient grad (fp32, bf16 or fp16), the half-precision parameter out (or None) written
        from it, the compressed moments of parts (bf16 or int8) read and written."""
        n = p32.numel()
        assert grad.numel() == n and (out is None or out.numel() == n) and p32.dtype == torch.float32
        args = _args(cfg, step, (1 - cfg.beta2 ** step) ** 0.5, grad, out, inv_scale, coef)
        qm, qv, threads = parts["exp_avg"], parts["exp_avg_sq"], torch.get_num_threads()
        pout = None if out is None else _p(out)
        if qm.dtype == torch.bfloat16:
            self.lib.pstar_adam_bf16(ctypes.byref(args), _p(p32), pout, _p(grad), _p(qm), _p(qv), n, first, seed,
                                     threads)
        else:
            self.lib.pstar_adam_int8(ctypes.byref(args), _p(p32), pout, _p(grad), _p(qm), _p(qv),
                                     _p(parts["exp_avg.scale"]), _p(parts["exp_avg_sq.scale"]), n, first, seed,
                                     threads)

    def adam_exact(self, cfg, step: float, master, out, grad, m, v, *, inv_scale: float = 1.0,
                   coef: float = 1.0) -> None:
        """One Adam / AdamW update (cfg: optim.AdamConfig; step: the count after it) of the fp32 master with the
        half-precision gradient grad, the half-precision parameter out written from it, the fp32 moments m and v:
        torch's fused CPU kernel's vector loop in one pass (adam.c pstar_adam_exact). The element count must be a
        multiple of 16 (torch's scalar loop takes a tensor's last n % 16 elements, and rounds otherwise). Its scalars
        as torch's kernel makes them: in double from the step, then rounded to fp32."""
        n = master.numel()
        assert n % 16 == 0 and all(t.numel() == n for t in (out, grad, m, v))
        assert master.dtype == m.dtype == v.dtype == torch.float32 and out.dtype != torch.float32
        args = _args(cfg, step, math.sqrt(1 - cfg.beta2 ** step), grad, out, inv_scale, coef)   # (torch's sqrt)
        self.lib.pstar_adam_exact(ctypes.byref(args), _p(master), _p(out), _p(grad), _p(m), _p(v), n,
                                  torch.get_num_threads())


def _args(cfg, step: float, bc2_sqrt: float, grad, out, inv_scale: float, coef: float) -> AdamArgs:
    """adam.c's scalars of one update (cfg: optim.AdamConfig; step: the count after it), each in double, rounded to
    fp32 by ctypes; bc2_sqrt: sqrt(1 - beta2^step), as the caller's reference computes it."""
    return AdamArgs(decay=1 - cfg.lr * cfg.weight_decay, weight_decay=cfg.weight_decay, w1=1 - cfg.beta1,
                    beta2=cfg.beta2, w2=1 - cfg.beta2, eps=cfg.eps, step_size=cfg.lr / (1 - cfg.beta1 ** step),
                    bc2_sqrt=bc2_sqrt, inv_scale=inv_scale, coef=coef, decoupled=int(cfg.decoupled),
                    maximize=int(cfg.maximize), grad_kind=_KINDS[grad.dtype],
                    out_kind=0 if out is None else _KINDS[out.dtype])


def reproduces_torch(kernels: Kernels, cfg, grad_dtype: torch.dtype, out_dtype: torch.dtype, by_torch) -> bool:
    """Whether `kernels.adam_exact` computes this kind of update bit for bit as the torch route `by_torch(cfg, param,
    grad, m, v, step, master, inv_scale, coef)` does (torch's fused kernel, as this build of torch rounds it on this
    processor): tried once per kind (Adam or AdamW, maximize, weight decay or none, the lerp's branch, the dtypes) on
    4096 elements of values over many magnitudes, zeros among them, from a generator of its own (the global one is
    not drawn from)."""
    key = exact_kind(cfg, grad_dtype, out_dtype)
    ok = kernels.verified.get(key)
    if ok is None:
        ok = kernels.verified[key] = _same_bits(kernels, cfg, grad_dtype, out_dtype, by_torch)
    return ok


def exact_kind(cfg, grad_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple:
    """What decides how torch's kernel rounds an update: Adam or AdamW, maximize, weight decay or none, the lerp's
    branch (1 - beta1 below 0.5 or not), the gradient's and parameter's dtypes."""
    return cfg.decoupled, cfg.maximize, cfg.weight_decay != 0, abs(1 - cfg.beta1) < 0.5, grad_dtype, out_dtype


def _same_bits(kernels: Kernels, cfg, grad_dtype, out_dtype, by_torch, n: int = 4096) -> bool:
    g = torch.Generator().manual_seed(0)

    def spread(lo: float, hi: float) -> torch.Tensor:
        return torch.logspace(lo, hi, n)[torch.randperm(n, generator=g)]

    master = torch.randn(n, generator=g) * spread(-6, 2)
    m = torch.randn(n, generator=g) * spread(-8, -1)
    v = torch.rand(n, generator=g) * spread(-12, -2)
    grad = (torch.randn(n, generator=g) * spread(-8, 1)).to(grad_dtype)
    m[::17], v[::13], grad[::19] = 0, 0, 0
    ours = [t.clone() for t in (master, m, v, grad)] + [master.to(out_dtype)]
    theirs = [t.clone() for t in ours]
    kernels.adam_exact(cfg, 3.0, ours[0], ours[4], ours[3], ours[1], ours[2], inv_scale=0.125, coef=0.75)
    by_torch(cfg, theirs[4], theirs[3], theirs[1], theirs[2], torch.tensor(3.0), theirs[0], 0.125, torch.tensor(0.75))
    return all(torch.equal(a.view(torch.int32 if a.dtype == torch.float32 else torch.int16),
                           b.view(torch.int32 if b.dtype == torch.float32 else torch.int16))
               for a, b in zip(ours, theirs))


def _p(t: torch.Tensor) -> int:
    assert t.device.type == "cpu" and t.is_contiguous(), (t.device, t.shape, t.stride())
    return t.data_ptr()


def kernels() -> Kernels | None:
    """The native kernels, or None where they cannot be built or loaded here (why_not() says why)."""
    lib, _ = _load()
    return lib


def why_not() -> str | None:
    """Why kernels() is None (None when it is not)."""
    return _load()[1]


@functools.cache
def _load() -> tuple[Kernels | None, str | None]:
    if os.environ.get("PSTAR_FX_NATIVE", "1") == "0":
        return None, "PSTAR_FX_NATIVE=0"
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None, f"no C compiler ({cc!r} is not on PATH; set CC)"
    text = b"".join(f.read_bytes() for f in _SOURCES + _HEADERS)
    key = hashlib.sha256(text + " ".join([cc, *_FLAGS, _processor()]).encode()).hexdigest()[:16]
    try:
        directory = _cache_dir()
    except OSError as e:
        return None, f"no cache directory for the native kernels: {e}"
    path = directory / f"kernels-{key}.so"
    if not path.exists():
        err = _build(cc, directory, path)
        if err:
            return None, err
    try:
        lib = ctypes.CDLL(str(path))
        for name, args in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, (ctypes.c_int if name == "pstar_has_fp16" else None)
    except (OSError, AttributeError) as e:
        return None, f"could not load {path}: {e}"
    return Kernels(lib, fp16=bool(lib.pstar_has_fp16())), None


def _build(cc: str, directory: Path, path: Path) -> str | None:
    """Compile into a temporary file in `directory`, then rename it into place (another process building the same
    library at once is harmless). An error message, or None."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                              timeout=120)
        if done.returncode != 0:
            return f"{cc} failed: {done.stderr.strip()[-500:]}"
        os.replace(tmp, path)
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cc} failed: {e}"
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cache_dir() -> Path:
    """The build directory, made private to its owner; refused (OSError) if another user could write in it."""
    root = os.environ.get("PSTAR_FX_CACHE")
    if root:
        directory = Path(root)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = Path(base) / "pstar_fx"
    directory = directory / "native"
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = directory.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"{directory} is not private to this user (owner {st.st_uid}, mode {oct(st.st_mode & 0o777)})")
    return directory


def _processor() -> str:
    """What -march=native compiles for: the machine and, on Linux, the processor's model and feature flags."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    text += line
                if line.strip() == "":
                    break
    except OSError:
        pass
    return text
