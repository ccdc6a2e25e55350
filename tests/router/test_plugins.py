"""The plugin registry: a scorer registered by name and named in RouterConfig changes routing
without touching the router core; bad names and parameters are refused with what to fix."""

import numpy as np
import pytest
from pydantic import BaseModel

from dynamograph.protocol.hashing import block_hash_array
from dynamograph.protocol.kv_events import BlockStored, EventBatch
from dynamograph.protocol.router_config import PluginRef, RouterConfig, ScorerRef, dynamo_scorers
from dynamograph.router.fleet import Candidates
from dynamograph.router.plugins.base import REGISTRY, Context, Scorer, register
from dynamograph.router.scheduler import Router, RouteRequest

pytestmark = pytest.mark.unit

BS = 16


class AvoidParameters(BaseModel):
    worker_id: int
    penalty: float = 1000.0


class AvoidWorker(Scorer):
    """A test's own scorer: a fixed cost on one worker."""

    name = "avoid-worker"
    Parameters = AvoidParameters

    def score(self, ctx: Context, c: Candidates) -> np.ndarray:
        p = self.parameters
        return np.array([p.penalty if w == p.worker_id else 0.0 for w in c.fleet.worker_ids])


@pytest.fixture
def avoid_worker():
    register(AvoidWorker)
    yield AvoidWorker
    del REGISTRY["scorer"][AvoidWorker.name]


def router_with(config: RouterConfig) -> Router:
    router = Router(config)
    for wid in (1, 2, 3):
        router.add_worker(wid, block_size=BS, total_blocks=1000)
    tokens = list(range(64))
    batch = EventBatch(0.0, [BlockStored([11, 12, 13, 14], None, tokens, BS, None)])
    assert router.apply_kv_batch(2, 0, batch) is None  # worker 2 holds the prompt
    return router


def route(router: Router) -> int:
    tokens = list(range(64))
    request = RouteRequest("r", block_hash_array(tokens, BS), len(tokens), query_only=True)
    return router.schedule(request).decode.worker_id


def test_a_registered_scorer_changes_routing(avoid_worker):
    assert route(router_with(RouterConfig(seed=1))) == 2  # the KV cost alone: the cached worker
    avoided = [*dynamo_scorers(), ScorerRef(type="avoid-worker", parameters={"worker_id": 2})]
    router = router_with(RouterConfig(scorers=avoided, seed=1))
    assert route(router) != 2
    # its weight scales it like any other scorer: at 0 it no longer counts
    avoided[-1] = avoided[-1].model_copy(update={"weight": 0.0})
    assert route(router_with(RouterConfig(scorers=avoided, seed=1))) == 2


def test_unknown_plugins_are_refused_with_the_registered_names():
    with pytest.raises(
        ValueError, match=r"unknown scorer 'kv-overlapp' \(registered: .*kv-overlap"
    ):
        Router(RouterConfig(scorers=[ScorerRef(type="kv-overlapp")]))
    with pytest.raises(ValueError, match="unknown picker 'best'"):
        Router(RouterConfig(picker=PluginRef(type="best")))
    with pytest.raises(ValueError, match="unknown filter 'queue'"):
        Router(RouterConfig(filters=[PluginRef(type="queue")]))


def test_bad_parameters_name_the_plugin_and_the_field(avoid_worker):
    bad = [ScorerRef(type="avoid-worker", parameters={"worker": 2})]
    with pytest.raises(ValueError, match=r"scorer 'avoid-worker'\.worker_id: Field required"):
        Router(RouterConfig(scorers=bad))
    with pytest.raises(ValueError, match=r"scorer 'load'\.x: unknown field"):
        Router(RouterConfig(scorers=[ScorerRef(type="load", parameters={"x": 1})]))


def test_hard_constraints_cannot_be_configured_away_or_twice():
    with pytest.raises(ValueError, match="filters role always apply"):
        Router(RouterConfig(filters=[PluginRef(type="role")]))
    # without the busy filter nothing sheds, but roles and readiness still hold
    router = router_with(RouterConfig(filters=[], busy_threshold=0.01, seed=1))
    router.set_ready(2, False)
    assert route(router) in (1, 3)


def test_a_name_is_registered_once(avoid_worker):
    class Other(Scorer):
        name = "avoid-worker"

    with pytest.raises(ValueError, match="already registered"):
        register(Other)


def test_the_queue_scorer_weighs_waiting_requests():
    scorers = [*dynamo_scorers(), ScorerRef(type="queue", parameters={"blocks_per_request": 64})]
    router = router_with(RouterConfig(scorers=scorers, seed=1))
    assert route(router) == 2  # nothing waits anywhere: the cached worker
    router.update_load(2, 0, waiting=1)  # 64 blocks of queue > 4 uncached blocks elsewhere
    assert route(router) != 2
    router.update_load(2, 0, waiting=0)
    assert route(router) == 2
