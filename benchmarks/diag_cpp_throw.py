"""Does a C++ op's TORCH_CHECK raise a catchable error on this machine, or crash the process?

On the H200 image (torch 2.11.0+cu130, Ubuntu's g++-real 13.3) `torchkiln::cpu_gemv`'s backstop
check segfaulted when its message held a number: the library carried its own copy of libstdc++'s
stream code (std::ostream::_M_insert<long> defined in it, where this machine's build imports it),
and c10::str's integer insertion crashed in that copy. This builds three one-line ops, each with
the build flags cpu_gemv.py uses, and calls each in a child process with a native backtrace on a
crash (an LD_PRELOAD signal handler: the image has no gdb):

  C string           TORCH_CHECK(false, "a C string")                   no stream at all
  integer via c10    TORCH_CHECK(false, "got ", n)                      c10::str's ostringstream
  std::to_string     TORCH_CHECK(false, ("got " + to_string(n)).c_str())  what cpu_gemv.cpp does

    python benchmarks/diag_cpp_throw.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from torchkiln.kernels import cpu_gemv

HEAD = "#include <string>\n#include <torch/library.h>\nnamespace {\n"
OPS = {
    "C string": 'TORCH_CHECK(false, "a C string");',
    "integer via c10": 'TORCH_CHECK(false, "got ", x.size(0));',
    "std::to_string": 'TORCH_CHECK(false, ("got " + std::to_string(x.size(0))).c_str());',
}
BODY = """at::Tensor op(const at::Tensor& x) {{ {check} return x; }}
}}
TORCH_LIBRARY_FRAGMENT(diag_throw, m) {{ m.def("op(Tensor x) -> Tensor"); }}
TORCH_LIBRARY_IMPL(diag_throw, CPU, m) {{ m.impl("op", op); }}
"""
SEGV = r"""#include <execinfo.h>
#include <signal.h>
#include <unistd.h>
static void h(int s) { void* b[64]; int n = backtrace(b, 64); backtrace_symbols_fd(b, n, 2); _exit(139); }
__attribute__((constructor)) static void init(void) { signal(SIGSEGV, h); }
"""
CHILD = ("import sys, torch; torch.ops.load_library(sys.argv[1])\n"
         "try:\n    torch.ops.diag_throw.op(torch.ones(3))\n"
         "except RuntimeError as e:\n    print('raised:', str(e).splitlines()[0])\n")


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    (tmp / "segv.c").write_text(SEGV)
    env = dict(os.environ)
    if subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp / "segv.so"), str(tmp / "segv.c")]).returncode == 0:
        env["LD_PRELOAD"] = str(tmp / "segv.so")
    cxx = cpu_gemv._compiler()
    print(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[0])
    for name, check in OPS.items():
        src, lib = tmp / f"{len(check)}.cpp", tmp / f"{len(check)}.so"
        src.write_text(HEAD + BODY.format(check=check))
        cmd = [str(src) if a == str(cpu_gemv.SOURCE) else a for a in cpu_gemv._command(cxx, lib)]
        built = subprocess.run(cmd, capture_output=True, text=True)
        if built.returncode:
            print(f"{name:16s} build failed: {built.stderr[-300:]}")
            continue
        own = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
        ran = subprocess.run([sys.executable, "-c", CHILD, str(lib)], capture_output=True, text=True, env=env)
        print(f"{name:16s} rc={ran.returncode} {ran.stdout.strip()}  (defines its own ostream insert: "
              f"{'_ZNSo9_M_insertIlEERSoT_' in own})")
        if ran.returncode:
            print(ran.stderr[-3000:])


if __name__ == "__main__":
    main()
