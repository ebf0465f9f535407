import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200, see docs/gpu.md)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fresh_cuda_graph_trees(request):
    """Each CUDA test starts with no compiled graphs or CUDA-graph trees left by the one before:
    on torch 2.11 a reduce-overhead compile that followed tk.optimize of a torchao-quantized model
    (tests/quantization/test_cuda_quant.py) in the same process failed inside cudagraph_trees
    (``assert len(node.tensor_weakrefs) == len(node.stack_traces)`` in dealloc_current_path_weakrefs),
    while each file alone passed."""
    yield
    if "cuda" in request.keywords and torch.cuda.is_available():
        from torch._inductor import cudagraph_trees

        torch._dynamo.reset()
        cudagraph_trees.reset_cudagraph_trees()
