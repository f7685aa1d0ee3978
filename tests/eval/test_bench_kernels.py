"""`eval.bench_kernels`: the GEMM-library switch of the job-interference table restores what it changed."""

import pytest
import torch

from eval.bench_kernels import gemm_library


def test_gemm_library_none_changes_nothing():
    before = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    with gemm_library(None) as label:
        assert label == "cuBLAS"
        assert (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()) == before


@pytest.mark.gpu
def test_gemm_library_carveout_is_set_inside_and_restored_after_an_error():
    before = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    with pytest.raises(RuntimeError, match="inside"), gemm_library(16) as label:
        assert label == "cuBLASLt, 16 SMs left out"
        assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Cublaslt
        assert torch._C._get_sm_carveout_experimental() == 16
        x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(torch.nn.functional.linear(x, w), (x.float() @ w.float().T).bfloat16(),
                                   rtol=2e-2, atol=2e-1)
        raise RuntimeError("inside")
    assert (torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()) == before
