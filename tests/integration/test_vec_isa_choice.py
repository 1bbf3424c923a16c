"""Inductor's switch `cpp.vec_isa_ok`, which `compile/vec_isa.py` sets on a host whose check passed,
only takes the candidates' base check as passed: the same ISAs are valid, the same one is picked
with the same build flags (its sub-feature checks, AVX-512 BF16, VNNI, AMX, still run), as when
every check inductor makes passes. Each side in a fresh interpreter (inductor memoizes the check);
the test library builds are stubbed as passing, so a torch that skipped a sub-feature check under
the switch would show here as different flags."""

import json
import platform
import subprocess
import sys
import textwrap

import pytest

CODE = textwrap.dedent("""
    import json, sys
    from torch._inductor import config, cpu_vec_isa as v
    builds = []
    def passing(self, code):
        builds.append(str(self))
        return True
    v.VecISA.check_build = passing
    if sys.argv[1] == "switch":
        config.cpp.vec_isa_ok = True
    valid = v.valid_vec_isa_list()
    picked = v.pick_vec_isa()
    print(json.dumps({"valid": [str(i) for i in valid], "picked": str(picked),
                      "flags": [i.build_arch_flags() for i in valid], "builds": len(builds)}))
""")


def _side(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="inductor checks ISAs on x86-64 only")
def test_the_switch_picks_what_a_passing_check_picks():
    checked, switched = _side("check"), _side("switch")
    assert checked["valid"] and checked["picked"] != ""
    same = ("valid", "picked", "flags")
    assert {k: switched[k] for k in same} == {k: checked[k] for k in same}
    assert switched["builds"] < checked["builds"]  # the base checks were skipped, and only they
