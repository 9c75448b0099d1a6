"""Thin Ray actors around the `dloco.services`, the Ray transport and the launcher.

- `actors.learner.Learner`, `actors.store.FragmentStore`, `actors.syncer.Syncer`: plain classes,
  wrapped with `ray.remote` by `actors.launch`; `actors.transport`: the Ray transport.
- the in-process transport (no Ray) is `dloco.sim`.
- `actors.launch.start(config) -> RunHandle`, and the `dloco` command line (`actors.cli`).
"""
