"""Thin Ray actors around the `dloco` cores, the launcher and the in-process reference driver.

- `actors.learner.Learner`, `actors.store.FragmentStore`, `actors.syncer.Syncer`: plain classes,
  wrapped with `ray.remote` by `actors.launch`.
- `actors.local`: the same cores driven in one process on a virtual clock (no Ray).
- `actors.launch.start(config) -> RunHandle`, and the `dloco` command line (`actors.cli`).
"""
