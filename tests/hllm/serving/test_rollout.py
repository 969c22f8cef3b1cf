"""The rollout's library half (hllm.serving.rollout): routing names, sticky buckets, agreement, the state machine."""

import numpy as np
import pytest

from hllm.data.splits import unit_hash
from hllm.serving.rollout import (CanaryConfig, registry_version, Guards, ModelCatalog, Rollout, RolloutConfig, ShadowConfig, UnknownModel,
                                  Window, pair_agreement, read_decisions, status_table, write_decision)


class Registry:
    """A registry stand-in for the pin callable: alias -> version, counting calls, able to go down."""

    def __init__(self):
        self.aliases = {"models:/hllm-student@champion": "models:/hllm-student/1",
                        "models:/hllm-student@challenger": "models:/hllm-student/2"}
        self.calls, self.down = 0, False

    def __call__(self, uri):
        self.calls += 1
        if self.down:
            raise ConnectionError("registry down")
        return self.aliases[uri]


@pytest.fixture
def clock():
    class Clock:
        now = 1000.0

        def __call__(self):
            return self.now
    return Clock()


def catalog(registry, clock, ttl=15.0):
    return ModelCatalog({"champion": "models:/hllm-student@champion", "challenger": "models:/hllm-student@challenger",
                         "legal": "/models/legal", "shipped": "smollm2-trec-dl"}, pin=registry, pin_ttl_s=ttl, clock=clock)


def test_names_resolve_to_immutable_models(clock):
    registry = Registry()
    c = catalog(registry, clock)
    assert c.resolve(None).uri == "models:/hllm-student/1" and c.resolve(None).name == "champion"  # the default: first
    assert c.resolve("challenger").uri == "models:/hllm-student/2"
    assert c.resolve("legal").uri == "/models/legal" and c.resolve("/models/legal").name == "legal"  # told-about folder
    assert c.resolve("shipped").uri == "smollm2-trec-dl"
    assert c.resolve("hllm-student/7").uri == "models:/hllm-student/7"  # NAME/VERSION of a served registered model
    assert c.resolve("hllm-student@champion").uri == "models:/hllm-student/1"  # NAME@ALIAS, pinned
    assert c.resolve("models:/hllm-student@challenger").uri == "models:/hllm-student/2"
    with pytest.raises(UnknownModel) as err:
        c.resolve("other-model@champion")  # a registered name the app does not serve: not loaded on request
    assert "champion" in err.value.known and "hllm-student@<alias>" in err.value.known
    assert "not served here" in str(err.value)
    for bad in ["nope", "/etc", "../models/legal", "hllm-student", "hllm-student/x"]:
        with pytest.raises(UnknownModel):
            c.resolve(bad)


def test_a_moved_alias_is_seen_after_the_ttl_and_a_registry_outage_keeps_the_last_pin(clock):
    registry = Registry()
    c = catalog(registry, clock, ttl=10)
    assert c.resolve("champion").uri == "models:/hllm-student/1"
    calls = registry.calls
    registry.aliases["models:/hllm-student@champion"] = "models:/hllm-student/2"
    clock.now += 5
    assert c.resolve("champion").uri == "models:/hllm-student/1" and registry.calls == calls  # cached
    clock.now += 6
    assert c.resolve("champion").uri == "models:/hllm-student/2"  # re-pinned: the new version, never a stale cache
    calls = registry.calls
    c.forget("models:/hllm-student@champion")  # an alias this app just moved: asked again now, not after the TTL
    assert c.resolve("champion").uri == "models:/hllm-student/2" and registry.calls == calls + 1
    clock.now += 11
    registry.down = True
    assert c.resolve("champion").uri == "models:/hllm-student/2" and c.pin_failures == 1  # last pin kept, counted
    with pytest.raises(ConnectionError):  # never pinned and the registry down: said, not guessed
        catalog(registry, clock).resolve("challenger")


def test_catalog_config_errors():
    with pytest.raises(ValueError, match="at least one"):
        ModelCatalog({})
    with pytest.raises(ValueError, match="default student"):
        ModelCatalog({"a": "/m"}, default="b")
    with pytest.raises(ValueError, match="alias needs the registry"):
        ModelCatalog({"a": "models:/m@champion"})


def test_buckets_are_stable_uniform_and_sticky_as_the_share_grows():
    keys = [f"tenant-{i}" for i in range(4000)]
    values = np.array([unit_hash(f"v2:{k}") for k in keys])
    assert values.min() >= 0 and values.max() < 1
    assert abs((values < 0.1).mean() - 0.1) < 0.02 and abs((values < 0.5).mean() - 0.5) < 0.03
    assert [unit_hash(f"v2:{k}") for k in keys[:10]] == list(values[:10])  # the same on every call (and replica)
    in_10 = {k for k, v in zip(keys, values) if v < 0.1}
    in_25 = {k for k, v in zip(keys, values) if v < 0.25}
    assert in_10 <= in_25  # a tenant in the canary stays in as its share grows
    assert np.mean([unit_hash(f"v3:{k}") < 0.1 for k in in_10]) < 0.3  # a new version draws a new sample
    # the project's one hash is the one that has always split queries (DL19's 1037798: every recorded figure's split)
    assert unit_hash("1037798") == 0.6992953973122163


def test_pair_agreement():
    assert pair_agreement([0, 1, 2, 3], [0, 1, 2, 3]) == (1.0, 1.0)
    tau, overlap = pair_agreement(list(range(20)), list(range(20))[::-1])
    assert tau == pytest.approx(-1.0) and overlap == 0.0
    tau, overlap = pair_agreement(list(range(12)), [1, 0] + list(range(2, 12)))
    assert 0.9 < tau < 1 and overlap == 1.0
    assert pair_agreement([0], [0]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="same documents"):
        pair_agreement([0, 1], [0, 2])


def window(candidate=0, champion=0, cand_ms=10.0, champ_ms=10.0, errors=0, taus=(), overlap=1.0):
    w = Window()
    for _ in range(champion):
        w.record("champion", champ_ms)
    for i in range(candidate):
        w.record("candidate", cand_ms, ok=i >= errors)
    for t in taus:
        w.pair(t, overlap)
    return w


def config(shadow=True, canary=True, **guards):
    return RolloutConfig(shadow=ShadowConfig("challenger", share=1.0) if shadow else None,
                         canary=CanaryConfig("challenger", share=0.1, step_share=0.2, max_share=0.5) if canary else None,
                         guards=Guards(min_requests=10, **guards), interval_s=1)


def test_a_healthy_candidate_goes_shadow_canary_steps_promote(clock):
    r = Rollout(config(), "models:/hllm-student/2", clock=clock)
    assert (r.phase, r.share, r.shadowing) == ("shadow", 0.0, True)
    assert r.tick() is None  # nothing judged yet
    r.observe(window(candidate=5, champion=5, taus=[0.8] * 5))
    assert r.tick() is None  # 5 < min_requests
    r.observe(window(candidate=5, champion=5, taus=[0.8] * 5))
    d = r.tick()
    assert (d.action, r.phase, r.share) == ("step", "canary", 0.1) and d.window["pairs"] == 10
    shares = [0.1]
    while not r.done:
        r.observe(window(candidate=10, champion=30, taus=[0.7] * 10))
        d = r.tick()
        shares.append(r.share)
    assert d.action == "promote" and r.phase == "promoted" and "alias champion moves" in d.reason
    assert shares == [0.1, 0.3, 0.5, 0.0]
    assert [x.action for x in r.decisions] == ["start", "step", "step", "step", "promote"]
    assert r.tick() is None and r.observe(window(candidate=50, errors=50)) is None  # done is done


@pytest.mark.parametrize("guard,w,needle", [
    ("errors", window(candidate=20, champion=20, errors=2, taus=[0.9] * 20), "error rate 2/20"),
    ("latency", window(candidate=20, champion=20, cand_ms=100, champ_ms=10, taus=[0.9] * 20), "p50 100.0 ms over 1.5"),
    ("agreement", window(candidate=20, champion=20, taus=[0.1] * 20), "agreement with the champion (Kendall tau) 0.100"),
])
def test_each_guard_rolls_back_with_its_figures(clock, tmp_path, guard, w, needle):
    r = Rollout(config(shadow=False), "models:/hllm-student/2", clock=clock)
    assert r.phase == "canary" and r.share == 0.1
    assert r.observe(w) is None or guard == "errors"
    d = r.decisions[-1] if r.done else r.tick()
    assert d.action == "rollback" and r.phase == "rolled_back" and r.share == 0.0 and needle in d.reason, d.reason
    log = tmp_path / "rollout.jsonl"
    for decision in r.decisions:
        write_decision(log, decision)
    with log.open("a") as f:
        f.write('{"torn": ')  # a crash mid-write
    back = read_decisions(log)
    assert back == r.decisions
    table = status_table(back)
    assert "rollback" in table and needle.split()[0] in table and "now: models:/hllm-student/2 rolled_back" in table


def test_p99_is_judged_only_on_enough_calls_and_catches_a_slow_tail(clock):
    """A tail the median does not show: 3% of the candidate's calls take 200 ms. With 20 calls a window its p99 is
    its maximum, so it is left to the median (which passes); with 100 calls on both arms the p99 rolls it back."""
    def tail(n):
        w = window(candidate=0, champion=n, champ_ms=10, taus=[0.9] * n)
        for i in range(n):
            w.record("candidate", 200.0 if i % 33 == 0 else 10.0)
        return w

    small = Rollout(config(shadow=False, p99_min_calls=100), "v", clock=clock)
    small.observe(tail(20))
    assert small.tick().action == "step"  # judged healthy: the p99 of 20 calls is not judged
    big = Rollout(config(shadow=False, p99_min_calls=100), "v", clock=clock)
    big.observe(tail(100))
    d = big.tick()
    assert d.action == "rollback" and d.reason.startswith("p99 ") and d.window["candidate_p50_ms"] == 10.0


def test_a_crashing_candidate_is_rolled_back_before_min_requests(clock):
    r = Rollout(config(shadow=False, max_error_rate=0.05), "v", clock=clock)
    assert r.observe(window(candidate=1, errors=0)) is None
    d = r.observe(window(candidate=1, errors=1))  # 1 error > 0.05 * max(10, 2): at once, no tick needed
    assert d is not None and d.action == "rollback" and "error rate 1/2" in d.reason


def test_latency_is_judged_in_the_canary_not_in_the_shadow(clock):
    """The shadow runs in its own lower-priority pool: a slow shadow phase is no breach; the same window in the
    canary is."""
    r = Rollout(config(), "v", clock=clock)
    r.observe(window(candidate=10, champion=10, cand_ms=100, champ_ms=10, taus=[0.9] * 10))
    assert r.tick().action == "step" and r.phase == "canary"
    r.observe(window(candidate=10, champion=10, cand_ms=100, champ_ms=10, taus=[0.9] * 10))
    assert r.tick().action == "rollback"


def test_shadow_only_is_judged_and_a_canary_without_alias_stays(clock):
    r = Rollout(config(canary=False), "v", clock=clock)
    r.observe(window(candidate=10, champion=10, taus=[0.9] * 10))
    assert r.tick().action == "promote" and r.phase == "promoted" and r.share == 0.0
    cfg = RolloutConfig(canary=CanaryConfig("c", share=0.5, max_share=0.5, promote_alias=None),
                        guards=Guards(min_requests=5))
    r = Rollout(cfg, "v", clock=clock)
    r.observe(window(candidate=5, champion=5, taus=[0.9] * 5))
    assert r.tick() is None and r.phase == "canary" and r.share == 0.5


def test_rollout_config_errors():
    with pytest.raises(ValueError, match="shadow, canary or both"):
        RolloutConfig()
    with pytest.raises(ValueError, match="same model"):
        RolloutConfig(shadow=ShadowConfig("a"), canary=CanaryConfig("b"))
    with pytest.raises(ValueError, match="sticky_by"):
        CanaryConfig("a", sticky_by="cookie")
    with pytest.raises(ValueError, match="max_share"):
        CanaryConfig("a", share=0.6, max_share=0.5)
    with pytest.raises(ValueError, match="shadow"):
        ShadowConfig("a", share=0)
    cfg = RolloutConfig(shadow={"model": "a", "share": 0.5}, canary={"model": "a"}, guards={"min_requests": 3})
    assert cfg.shadow.share == 0.5 and cfg.guards.min_requests == 3 and cfg.candidate == "a"
    assert CanaryConfig("a", share=0.05, step_share=0.2, max_share=0.5).shares() == [0.05, 0.25, 0.45, 0.5]


def test_registry_version():
    assert registry_version("models:/hllm-student/7") == ("hllm-student", "7")
    for bad in ("models:/hllm-student@champion", "/models/legal", "hllm-student/7"):
        with pytest.raises(ValueError, match="nothing to promote"):
            registry_version(bad)
