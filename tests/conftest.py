"""Session-wide fixtures: one real SeaweedFS S3 server and (lazily) one real Prefect server,
both started through the same infra code as `dflash services up`, on free loopback ports, with
their data under a temporary work dir.

Run everything: `.venv/bin/python -m pytest -q`
"""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path

import pytest

from dflash_core.settings import Settings
from dflash_core.storage import ObjectStore

# Test ports come from a block of its own for each xdist worker, below the kernel's ephemeral range (32768-60999
# on Linux). A port the kernel hands out (`bind(0)`, an outgoing connection's source port) can be taken by anyone
# between our check and a server's bind, which once made a `transformers serve` instance fail with EADDRINUSE;
# nothing else draws from these blocks. SeaweedFS opens gRPC at port + 10000, which lands at 22000-31999: below the
# ephemeral range too, and outside every block.
PORT_BLOCK_SIZE = 2000
FIRST_PORT_BLOCK = 12000
WORKER_BLOCKS = 4  # addopts' --maxprocesses; the plain (non-xdist) process takes the block after them
GRPC_OFFSET = 10000
_given_ports: set[int] = set()
_cursor: dict[int, int] = {}  # block start -> where the next walk begins


def port_block(worker: str | None = None) -> range:
    """The ports this process's tests take: xdist worker gwN gets block N; a plain run the block after them."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "") if worker is None else worker
    index = int(worker[2:]) % WORKER_BLOCKS if worker.startswith("gw") else WORKER_BLOCKS
    start = FIRST_PORT_BLOCK + index * PORT_BLOCK_SIZE
    return range(start, start + PORT_BLOCK_SIZE)


def free_port(*, grpc_offset: bool = False, count: int = 1) -> int:
    """The first of `count` consecutive free loopback ports from this process's block, none given out before; with
    grpc_offset each port + 10000 is free too (SeaweedFS opens gRPC there). The walk starts at a random place in the
    block, so two sessions on one machine rarely probe the same ports."""
    from dflash_core.services.process import port_is_free

    block = port_block()
    cursor = _cursor.setdefault(block.start, random.randrange(len(block)))
    for step in range(len(block)):
        base = block.start + (cursor + step) % len(block)
        ports = range(base, base + count)
        if ports.stop > block.stop or not _given_ports.isdisjoint(ports):
            continue
        if all(port_is_free(port) and (not grpc_offset or port_is_free(port + GRPC_OFFSET)) for port in ports):
            _given_ports.update(ports)
            _cursor[block.start] = (ports.stop - block.start) % len(block)
            return base
    raise RuntimeError(f"no {count} consecutive free loopback ports left in {block}")


# The xdist groups of the modules on a Prefect server: those that read the stage server or a shared run, and the
# others, each on its own worker with its own Prefect server (the shared runs are made once, in the first lane).
PREFECT_LANE = "prefect"
PREFECT_SOLO_LANE = "prefect-solo"
SHARED_SETUPS = {"stage_server", "whole_run", "retried_pipeline"}  # made after the Prefect server
_RUNNING: dict[str, pytest.Item] = {}  # the test being set up: its lane says which session setups to start


def _xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """One thread per process for the whole session, children included (training entries, servers): the
    tiny matmuls here run up to 10x slower on two threads of a busy 2-core machine, and module- and
    session-scoped fixtures (trained drafters, targets) are built before any function fixture could pin
    it. An OMP_NUM_THREADS set by the caller wins."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the group markers into node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test on the Prefect server is `slow`: the server takes ~15 s to start and each flow run
    starts processes of seconds each (training, inference servers, deployment runs). `-m "not slow"`
    then never starts it.

    Order: unit tests, other tests, then the modules with a test on the Prefect server, those reading the
    stage server or a shared run last, so that the setups tests/early.py starts run beside the tests that need
    none of them. A module's tests stay together (its module-scoped fixtures are made once).

    Under pytest-xdist (`--dist loadgroup`, pyproject's addopts) the modules on the Prefect server are two
    groups, the Prefect lanes: the modules that read the stage server or a shared run (one worker runs them
    on one Prefect server, stage server and pair of shared runs), and the others (another worker, on a Prefect
    server of its own); the workers take every other test one at a time beside them. One lane held both
    until 2026-12-04: 1,529 s of the suite's 2,728 s of test time on one worker, the other idle for the
    last ~5 minutes."""
    on_prefect = {getattr(item, "module", None) for item in items if "prefect_server" in item.fixturenames}
    on_shared = {getattr(item, "module", None) for item in items if SHARED_SETUPS & set(item.fixturenames)}
    for item in items:
        if "prefect_server" in item.fixturenames:
            item.add_marker(pytest.mark.slow)
        module = getattr(item, "module", None)
        if module in on_prefect:
            item.add_marker(pytest.mark.xdist_group(PREFECT_LANE if module in on_shared else PREFECT_SOLO_LANE))
    unit = f"{os.sep}tests{os.sep}unit{os.sep}"

    def lane_order(item: pytest.Item) -> int:
        module = getattr(item, "module", None)
        if module in on_prefect:
            return 3 if module in on_shared else 2
        return 0 if unit in str(item.path) else 1

    items.sort(key=lane_order)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _RUNNING["item"] = item  # before its fixtures: `prefect_server` reads the lane of the test that asks first


def lane_of(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return None if marker is None else (marker.args[0] if marker.args else marker.kwargs.get("name"))


def lane_items(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The tests whose session setups this process makes: all of them in one process; under xdist those of
    the lane of the test being set up (the other lane's worker makes its own)."""
    items = request.session.items
    running = _RUNNING.get("item")
    if not _xdist_worker(request.config) or running is None:
        return items
    return [item for item in items if lane_of(item) == lane_of(running)]


@pytest.fixture(scope="session", autouse=True)
def early(request: pytest.FixtureRequest):
    """The session's slowest setups, started now in the background if a selected test needs them (tests/early.py)."""
    from tests.early import Early

    setups = Early()
    if not _xdist_worker(request.config):
        setups.start(request, request.session.items)  # in an xdist worker a lane's first test starts them
    yield setups
    setups.close()


@pytest.fixture
def one_thread():
    """One torch thread for this test whatever OMP_NUM_THREADS says (pytest_configure already sets the
    session's default to one)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dflash-work")


@pytest.fixture(scope="session")
def settings(work_dir: Path) -> Settings:
    """Settings for this test session; never read from the developer's environment or .env."""
    return Settings(
        _env_file=None,
        s3_endpoint_url=f"http://127.0.0.1:{free_port(grpc_offset=True)}",
        s3_bucket="dflash-test",
        s3_access_key_id="test-access-key",
        s3_secret_access_key="test-secret-key-0123456789",
        s3_master_port=free_port(grpc_offset=True),
        s3_volume_port=free_port(grpc_offset=True),
        s3_filer_port=free_port(grpc_offset=True),
        s3_admin_port=free_port(grpc_offset=True),
        prefect_api_url=f"http://127.0.0.1:{free_port()}/api",
        work_dir=work_dir,
    )


@pytest.fixture(scope="session")
def s3_server(settings: Settings):
    from dflash_core.services import local

    service = local.s3_service(settings)
    local.start(service)
    yield service
    local.shutdown(service)


@pytest.fixture(scope="session")
def store(settings: Settings, s3_server) -> ObjectStore:
    return ObjectStore.from_settings(settings)


@pytest.fixture
def prefix() -> str:
    """A key prefix unique to one test, so tests sharing the bucket never see each other's objects."""
    return f"scratch/test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def prefect_server(settings: Settings, early, request: pytest.FixtureRequest):
    """A real Prefect server (SQLite) for the session, started early (tests/early.py); tests that use it talk to it
    via PREFECT_API_URL."""
    from dflash_core.services import local

    early.start(request, lane_items(request))

    def start_now():
        service = local.prefect_service(settings)
        local.start(service)
        return service

    service = early.get("prefect_server", start_now)
    saved = {key: os.environ.get(key) for key in local.prefect_client_env(settings)}
    os.environ.update(local.prefect_client_env(settings))
    # Prefect snapshots its settings when first imported; override them too in case it already was.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: settings.prefect_api_url}):
        yield service
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    local.shutdown(service)


@pytest.fixture(scope="session")
def demo_prompt_sample():
    """`embedded.demo_prompts()` once per session: each call streams the whole shipped ShareGPT file."""
    from dflash_core import embedded

    return embedded.demo_prompts()


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer, deep enough to tap (>= 4 layers): the pipeline tests' target."""
    from tests.tiny_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-target"), num_layers=4)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with the SmolLM2 tokenizer that `transformers serve` can load."""
    from tests.tiny_models import build_tiny_chat_model

    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture
def env_settings(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Export the session settings as DFLASH_* variables: flows resolve Settings from the environment."""
    for name, value in {
        "DFLASH_S3_ENDPOINT_URL": settings.s3_endpoint_url, "DFLASH_S3_BUCKET": settings.s3_bucket,
        "DFLASH_S3_ACCESS_KEY_ID": settings.s3_access_key_id.get_secret_value(),
        "DFLASH_S3_SECRET_ACCESS_KEY": settings.s3_secret_access_key.get_secret_value(),
        "DFLASH_WORK_DIR": str(settings.work_dir), "DFLASH_PREFECT_API_URL": settings.prefect_api_url,
    }.items():
        monkeypatch.setenv(name, value)
    return settings
