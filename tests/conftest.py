"""Suite-wide setup. Triton kernels run under the interpreter where no GPU exists;
the variable must be set before triton is first imported."""

import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Trained EAGLE-3 heads in the user's cache must not change what the suite runs
# (`--speculative auto` picks one up): every test, and every server it starts,
# sees an empty head cache unless it sets its own.
import tempfile  # noqa: E402

os.environ["EDGECHAT_EAGLE3_DIR"] = tempfile.mkdtemp(prefix="edgechat-eagle3-test-")


import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--build-kernels", action="store_true",
                     help="first build the C++ kernels the extension cache lacks, one per core (tests/kernel_builds.py)")


def pytest_sessionstart(session):
    if session.config.getoption("--build-kernels"):
        from tests.kernel_builds import build_missing

        account = build_missing()
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(account)


@pytest.fixture(scope="session")
def default_replica_server():
    """One real replica on the default model, shared by the client tests (tests/edge_proxy/test_browser.py,
    test_client_reconnect.py, tests/examples): (its http:// URL, its API process)."""
    from tests.replica.server import replica_server

    with replica_server("--replica-id", "R0", "--kv-memory-gb", "0.25") as served:
        yield served


@pytest.fixture(scope="session")
def default_replica(default_replica_server):
    """The shared default-model replica's http:// URL."""
    return default_replica_server[0]
