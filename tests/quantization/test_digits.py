"""Real data (#8): a small CNN trained on scikit-learn's digits keeps its test accuracy within
1 point of fp32 after int8-static, and after int8-static served through tk.optimize."""

import copy
import warnings

import pytest
import torch

import torchkiln as tk
from torchkiln.quantization import onednn_int8

pytest.importorskip("sklearn.datasets")
import needs  # noqa: E402
from digits import accuracy, cnn, digits, fit  # noqa: E402


@needs.pt2e
def test_int8_static_cnn_within_one_point_of_fp32():
    train, test = digits()
    ref = cnn().train()
    fit(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), train, 3, False)
    ref.eval()
    before = copy.deepcopy(ref.state_dict())
    calib = [train[0][i:i + 64] for i in range(0, 512, 64)]  # 8 training batches, no test images
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        q = tk.quantize(ref, "int8-static", calib_data=calib, progress=False)
        served = tk.optimize(ref, quantize="int8-static", calib_data=calib, sample_input=test[0][:64],
                             time_budget=0.5)
    # the half-model upcast warning fired on every int8 model ("float32 ... which this CPU only emulates")
    assert not any("only emulates" in str(w.message) for w in said), [str(w.message) for w in said]
    acc_ref = accuracy(ref, test)
    assert acc_ref > 0.9  # the reference learnt the task
    models = [q, served]
    if onednn_int8.available():  # the same int8 model through torch's oneDNN quantized modules
        models.append(onednn_int8.OneDNNInt8(q))
    for model in models:
        with torch.no_grad():
            acc = float((model(test[0]).argmax(-1) == test[1]).float().mean())
        assert acc >= acc_ref - 0.01, (acc, acc_ref)
    assert q.kiln_quant.report.quantized == 3  # both convs and the linear really are int8
    assert all(torch.equal(v, before[k]) for k, v in ref.state_dict().items())  # the caller's model untouched
