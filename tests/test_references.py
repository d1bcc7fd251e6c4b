"""The tests' references are the right ones: a test parametrised over devices must not compare an
offloaded model with a ``torch.optim`` optimizer stepping *device* parameters.

OffloadModel's parameters live on the host, so optimizers step them with host kernels; the same
optimizer over CUDA parameters runs other kernels (CUDA fused AdamW does its scalar math in double)
whose last bits differ. Such a test passes on the CPU and fails on a GPU for the wrong reason.
The reference must be stepped through ``HostStepped`` (tests/helpers.py). This file reads the test
sources and finds every ``torch.optim.<Class>(...)`` built in a device-parametrised test over
parameters that are neither an OffloadModel's nor inside ``HostStepped``.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_device_parametrised(function: ast.FunctionDef) -> bool:
    for decorator in function.decorator_list:
        if not (isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("parametrize")):
            continue
        if not decorator.args:
            continue
        names = decorator.args[0]
        if isinstance(names, ast.Constant) and isinstance(names.value, str) and "device" in names.value.split(","):
            values = ast.unparse(decorator.args[1]) if len(decorator.args) > 1 else ""
            if "DEVICES" in values or "cuda" in values:
                return True
    return False


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _host_names(function: ast.FunctionDef) -> set[str]:
    """Names whose parameters are an OffloadModel's: assigned from ``OffloadModel(...)``, or the
    layers passed to it (wrapping moves their parameters to the host)."""
    host: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("OffloadModel"):
            if node.args and isinstance(node.args[0], ast.Name):
                host.add(node.args[0].id)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func).endswith("OffloadModel"):
            for target in node.targets:
                host |= _names_in(target)
    return host


def _inside_host_stepped(function: ast.FunctionDef) -> set[int]:
    """ids of the nodes under a ``HostStepped(...)`` call."""
    inside: set[int] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("HostStepped"):
            inside |= {id(n) for n in ast.walk(node)}
    return inside


def _factory_arguments(function: ast.FunctionDef) -> set[str]:
    """Arguments of the functions and lambdas defined inside the test: an optimizer built over one
    is a factory (``make(params)``), judged where it is called, which this scan does not follow;
    the tests hand such factories to HostStepped."""
    names: set[str] = set()
    for node in ast.walk(function):
        if node is not function and isinstance(node, (ast.FunctionDef, ast.Lambda)):
            names |= {a.arg for a in node.args.args}
    return names


def device_stepped_references(source: str, filename: str) -> list[str]:
    """``file:line: call`` for each device-parameter optimizer in a device-parametrised test."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not (isinstance(function, ast.FunctionDef) and function.name.startswith("test")
                and _is_device_parametrised(function)):
            continue
        host, exempt = _host_names(function), _inside_host_stepped(function)
        factories = _factory_arguments(function)
        for statement in function.body:  # not the decorators: their lambdas are factories
            for node in ast.walk(statement):
                if not (isinstance(node, ast.Call) and ast.unparse(node.func).startswith("torch.optim.")
                        and node.args and id(node) not in exempt):
                    continue
                if ast.unparse(node.func).startswith("torch.optim.lr_scheduler"):
                    continue
                used = _names_in(node.args[0])
                if not used & host and not (isinstance(node.args[0], ast.Name) and used <= factories):
                    found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_device_parametrised_test_steps_a_reference_on_the_device():
    found = []
    for path in sorted(TESTS.glob("test_*.py")):
        found += device_stepped_references(path.read_text(), path.name)
    assert not found, ("torch.optim over device parameters as a reference in a test that runs on CUDA; step it "
                       "with HostStepped (tests/helpers.py):\n" + "\n".join(found))


def test_the_scan_finds_a_device_stepped_reference():
    bad = '''
@pytest.mark.parametrize("device", DEVICES)
def test_x(device):
    reference = plain.to(device)
    model = OffloadModel(copy.deepcopy(plain), device=device)
    ours = torch.optim.AdamW(model.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True)
    fine = HostStepped(reference, lambda params: torch.optim.AdamW(params, lr=1e-2))
'''
    assert device_stepped_references(bad, "t.py") == [
        "t.py:7: torch.optim.AdamW(reference.parameters(), lr=0.01, fused=True)"]
    assert device_stepped_references(bad.replace('"device", DEVICES', '"n", [1, 2]'), "t.py") == []
