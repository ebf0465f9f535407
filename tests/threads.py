"""Shared by the CPU and CUDA tests: concurrent calls must equal serial ones."""

import threading

import torch


def assert_threads_match_serial(model, xs, repeats: int = 5):
    serial = [model(x) for x in xs]
    results = [None] * len(xs)

    def work(i):
        for _ in range(repeats):
            results[i] = model(xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, serial, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    return serial
