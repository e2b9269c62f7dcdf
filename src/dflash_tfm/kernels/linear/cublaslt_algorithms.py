"""``y = x Wᵀ`` through cuBLASLt with an explicit algorithm: the ranked list of its heuristic, per shape.

torch's cuBLASLt path runs the heuristic's first algorithm only. For the 65-row tree-verify projections, that
choice and cuBLAS's own streamed the weights 5–10 % more slowly than the one-row GEMV (docs/PERFORMANCE.md,
issue 3). The algorithms ranked after it differ in tile, stages, split-K and cluster shape, and each becomes a
candidate of the projection's measured choice (`layers/linear.py`). The calls go through nvmath-python's
cuBLASLt bindings on the caller's stream, with a preallocated workspace, so they can be captured in CUDA
graphs. torch exposes no algorithm choice on CUDA (its TunableOp times only the default GEMM there), and
nvmath-python is NVIDIA's maintained binding of the library. It is optional (the ``gpu`` extra): without it, or
without a GPU, there are no candidates.
Each algorithm's twin is ``F.linear`` (GPU test: ``tests/kernels/test_cublaslt_algorithms.py``).
"""
from __future__ import annotations

import functools
import warnings

import numpy as np
import torch
import torch.nn.functional as F

MAX_ALGORITHMS = 8  # heuristic results asked for per shape (each one is timed at the shape's first call)
WORKSPACE_BYTES = 32 << 20  # what the split-K algorithms may use; one buffer per device, shared in stream order
ALIGNMENT = 256  # the heuristic's default assumption about every operand's address


@functools.cache
def bindings():
    """nvmath's cuBLASLt module (plus the cuBLAS and CUDA enums it needs), or None where it is not installed
    (or does not load: say, built against other CUDA bindings than the ones installed)."""
    try:
        from nvmath._utils import CudaDataType
        from nvmath.bindings import cublas, cublasLt
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 — a broken optional dependency only removes candidates
        warnings.warn(f"nvmath-python does not load ({type(e).__name__}: {e}); no cuBLASLt algorithm candidates")
        return None
    return cublasLt, cublas, CudaDataType


class _Device:
    """A cuBLASLt handle and the shared workspace of one GPU."""

    def __init__(self, device: torch.device) -> None:
        lt = bindings()[0]
        with torch.cuda.device(device):
            self.handle = lt.create()
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


_devices: dict[int, _Device] = {}
_problems: dict[tuple, "LtProblem | None"] = {}  # None: cuBLASLt refused the shape (warned once)


def _set(setter, obj: int, attr, value, dtype) -> None:
    buf = np.array(value, dtype=dtype)
    setter(obj, attr, buf.ctypes.data, buf.itemsize)


class LtProblem:
    """Descriptors and the heuristic's algorithms for ``out [M, N] = x [M, K] @ w [N, K]ᵀ``, all row-major.

    cuBLASLt is column-major: ``outᵀ (N × M, ld N) = op(A) · B`` with A the weight as a K × N matrix (ld K)
    transposed, and B = ``xᵀ`` as K × M (ld K)."""

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> None:
        lt, cublas, cuda_type = bindings()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in _devices:
            _devices[index] = _Device(torch.device("cuda", index))
        self.lt, self.device, self.shape = lt, _devices[index], (rows, n, k)
        element = {torch.bfloat16: cuda_type.CUDA_R_16BF, torch.float16: cuda_type.CUDA_R_16F}[dtype]
        self.desc = lt.matmul_desc_create(cublas.ComputeType.COMPUTE_32F, cuda_type.CUDA_R_32F)
        op_dtype = lt.get_matmul_desc_attribute_dtype(lt.MatmulDescAttribute.TRANSA)
        _set(lt.matmul_desc_set_attribute, self.desc, lt.MatmulDescAttribute.TRANSA, cublas.Operation.T, op_dtype)
        _set(lt.matmul_desc_set_attribute, self.desc, lt.MatmulDescAttribute.TRANSB, cublas.Operation.N, op_dtype)
        self.a = lt.matrix_layout_create(element, k, n, k)
        self.b = lt.matrix_layout_create(element, k, rows, k)
        self.d = lt.matrix_layout_create(element, n, rows, n)
        self.alpha, self.beta = np.ones(1, dtype=np.float32), np.zeros(1, dtype=np.float32)
        preference = lt.matmul_preference_create()
        try:
            attr = lt.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES
            _set(lt.matmul_preference_set_attribute, preference, attr, WORKSPACE_BYTES,
                 lt.get_matmul_preference_attribute_dtype(attr))
            self.results = np.zeros(MAX_ALGORITHMS, dtype=lt.matmul_heuristic_result_dtype)
            found = np.zeros(1, dtype=np.int32)
            lt.matmul_algo_get_heuristic(self.device.handle, self.desc, self.a, self.b, self.d, self.d, preference,
                                         MAX_ALGORITHMS, self.results.ctypes.data, found.ctypes.data)
        finally:
            lt.matmul_preference_destroy(preference)
        found = self.results[: int(found[0])]
        self.results = found[found["state"] == 0].copy()  # owns its memory: the algo pointers point into it
        self.names = [f"cublaslt#{i} {self._describe(i)}" for i in range(len(self.results))]

    def _algo(self, i: int) -> int:
        return self.results.ctypes.data + i * self.results.itemsize + self.results.dtype.fields["algo"][1]

    def _describe(self, i: int) -> str:
        """``id A tile T stages S split-k K cluster C`` of the i-th algorithm, for benchmark logs."""
        lt, parts = self.lt, []
        config = lt.MatmulAlgoConfigAttribute
        written = np.zeros(1, dtype=np.uint64)
        for label, attr, enum in (("id", config.ID, None), ("tile", config.TILE_ID, lt.MatmulTile),
                                  ("stages", config.STAGES_ID, lt.MatmulStages), ("split-k", config.SPLITK_NUM, None),
                                  ("cluster", config.CLUSTER_SHAPE_ID, lt.ClusterShape)):
            buf = np.zeros(1, dtype=lt.get_matmul_algo_config_attribute_dtype(attr))
            lt.matmul_algo_config_get_attribute(self._algo(i), attr, buf.ctypes.data, buf.itemsize,
                                                written.ctypes.data)
            value = int(buf[0])
            if enum is not None and value in enum._value2member_map_:
                value = enum(value).name.split("_", 1)[-1]  # TILE_64x128 -> 64x128
            parts.append(f"{label} {value}")
        return " ".join(parts)

    def run(self, x: torch.Tensor, weight: torch.Tensor, i: int) -> torch.Tensor:
        """``x @ weightᵀ`` with algorithm i, on the current stream (``F.linear`` for operands that are not
        contiguous and 256-byte aligned)."""
        rows, n, k = self.shape
        x2 = x.reshape(rows, k)
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        if not (x2.is_contiguous() and weight.is_contiguous()
                and all(t.data_ptr() % ALIGNMENT == 0 for t in (x2, weight, out))):
            return F.linear(x, weight)  # the algorithms were chosen for aligned operands (the engine's are)
        self.lt.matmul(self.device.handle, self.desc, self.alpha.ctypes.data, weight.data_ptr(), self.a,
                       x2.data_ptr(), self.b, self.beta.ctypes.data, out.data_ptr(), self.d, out.data_ptr(), self.d,
                       self._algo(i), self.device.workspace.data_ptr(), WORKSPACE_BYTES,
                       torch.cuda.current_stream(x.device).cuda_stream)
        return out.view(*x.shape[:-1], n)


def problem(rows: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> LtProblem | None:
    """The cached `LtProblem` of a shape, or None without nvmath-python, a CUDA device or a 16-bit dtype, or
    where cuBLASLt refused it (a warning says why)."""
    if bindings() is None or device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return None
    key = (rows, n, k, dtype, device)
    if key not in _problems:
        try:
            _problems[key] = LtProblem(rows, n, k, dtype, device)
        except Exception as e:  # noqa: BLE001 — cuBLASLt refusing the problem only removes candidates
            warnings.warn(f"no cuBLASLt algorithm candidates for {key[:3]}: {type(e).__name__}: {e}")
            _problems[key] = None
    return _problems[key]


def algorithm_index(name: str) -> int:
    """The heuristic rank in a candidate name made by `LtProblem` (``cublaslt#3 id …`` → 3)."""
    return int(name.split("#", 1)[1].split(" ", 1)[0])
