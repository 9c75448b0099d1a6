"""A learner told it is too far behind fetches before it pushes again (in process, virtual clock).

The store's mail to learner 1 is lost from t = 4 to t = 30 (as when its long poll hangs on a store
that restarted while it was frozen): its copy of the model stops advancing. The first push of a
fragment it then sends is refused (it overlaps a merge of its own that it never heard of, or its
base is more than `syncer.max_staleness` versions old), and the refusal tells it the fragment's
version: it holds its pushes of that fragment and fetches the fragment from the store in full
(at once when stale; after an overlap once `chaos.resend_s` has passed without the mail bringing
it). Without that it sends push after push that is refused (what a probe of a decoupled Ray run
around a store restart saw: 26 stale pushes in a row).
"""

from dloco import config
from dloco.sim import Sim


def test_a_learner_refused_as_stale_fetches_and_contributes_again(tmp_path, data_cache):
    cfg = config.load(
        None,
        [
            "preset=micro",
            f"data.cache_dir={data_cache}",
            "learners.count=3",
            "algorithm=decoupled",
            "sync.every=8",
            "sync.overlap=1",
            "fragments.count=2",
            "syncer.max_staleness=2",
            "syncer.quorum=1",
            "sync.dynamic=false",  # the push schedule the counts below were measured on
        ],
    )
    sim = Sim.start(cfg, tmp_path, step_times=[1.0, 1.0, 1.0], sync_time=0.1)
    deliver = sim._mail
    sim._mail = lambda m, updates: None if (m == 1 and 4.0 <= sim.now < 30.0) else deliver(m, updates)  # type: ignore[method-assign]
    sim.run(60)
    refused = [e for e in sim.events if e["event"] == "rejection" and e["learner"] == 1]
    merged = [e for e in sim.events if e["event"] == "merge" and 1 in e["contributors"] and e["time"] > 30]
    # measured: 2 refusals (one per fragment: an overlap, then a stale push), each followed by a
    # fetch; without the catch-up (`LearnerService.decided` a no-op) 6 refusals, one per push
    # from t = 12 to t = 32
    assert all(e["reason"].startswith(("stale", "overlap")) for e in refused)
    assert sorted((e["fragment"], e["base_version"]) for e in refused) == [(0, 0), (1, 0)]
    assert merged, "learner 1 contributes again"
    assert not sim.services[1].behind  # caught up at the end
