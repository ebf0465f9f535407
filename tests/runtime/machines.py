"""`lscpu -p=CPU,CORE,SOCKET,NODE` output of machines we do not have, in lscpu's exact format.

Numbering follows the kernel's on each: x86 lists every core's first thread, then the siblings
(cpu 48 is cpu 0's sibling on the Xeon); the Arm part has one thread per core.
"""

from torchkiln.hardware.topology import parse_lscpu_p

HEADER = """\
# The following is the parsable format, which can be fed to other
# programs. Each different item in every column has an unique ID
# starting usually from zero.
# CPU,Core,Socket,Node
"""

# Captured on the 2-core KVM guest this repository is developed on.
THIS_DEV_BOX = HEADER + "0,0,0,0\n1,1,0,0\n"

# Captured shape of a VM without NUMA information: the NODE column is empty, cpus 2/3 are siblings of 0/1.
NO_NUMA_HT = HEADER + "0,0,0,\n1,1,0,\n2,0,0,\n3,1,0,\n"


def _text(rows) -> str:
    return HEADER + "".join(f"{cpu},{core},{socket},{node}\n" for cpu, core, socket, node in sorted(rows))


def xeon_2s_ht() -> str:
    """2 sockets x 24 cores x 2 threads, one NUMA node per socket."""
    rows = ((t * 48 + s * 24 + c, s * 24 + c, s, s) for t in range(2) for s in range(2) for c in range(24))
    return _text(rows)


def epyc_nps4() -> str:
    """One socket, 64 cores with SMT, NPS4: 4 NUMA nodes of 16 cores."""
    return _text((t * 64 + c, c, 0, c // 16) for t in range(2) for c in range(64))


def neoverse_72() -> str:
    """72 Arm cores, one thread each, one node."""
    return _text((c, c, 0, 0) for c in range(72))


XEON = parse_lscpu_p(xeon_2s_ht())
EPYC = parse_lscpu_p(epyc_nps4())
ARM = parse_lscpu_p(neoverse_72())
