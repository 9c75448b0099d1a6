"""The protocol of a run, given a transport and a clock: learner, syncer and store services.

Each service is a plain class that holds one role's state and logic (`dloco.learner.LearnerCore`,
`dloco.syncer.SyncerCore`, `dloco.store.StoreCore` plus the messages between them) and reaches its
peers only through the objects handed to its constructor (`dloco.services.wire`): a `Transport`
(put/get of payloads), a `Clock`, and peer handles whose calls return results. Two transports
drive the same classes:

- `actors/` (Ray): peers are named actors, payloads travel through Ray's object store, the clock
  is the wall clock; the actor classes there only add threads, sleeps and Ray plumbing.
- `dloco.sim` (in process): peers are the other service objects, payloads are Python objects,
  the clock is virtual; faults (kills, freezes, lost payloads) happen one event at a time.

One round, file by file: `dloco.learner` (a step; a push falls due) → `services.learner` (encode,
put, `push` to the syncer) → `services.syncer` (validate into `dloco.policy`'s round; close it,
get the payloads, `dloco.syncer` merges and takes the outer step) → `services.store` (`dloco.store`
logs and acknowledges the commit; the commit names the learners due for it, `dloco.publish`) →
`services.learner` (the update arrives) → `dloco.learner` (install).
"""
