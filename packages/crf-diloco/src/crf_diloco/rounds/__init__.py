"""The phases of one round of `crf_diloco.allreduce.ObjectStoreAllReduce`, one module each.

``round``: the `Round` record, `RoundFailure` and `poll_until` (the one loop every wait uses); ``peer``: a replica's
typed view of the store (records, decisions); ``quorum``: announce and form the quorum; ``reduce``: contribute the
payload and reduce a shard; ``gather``: read the reduced shards; ``vote``: the decision and the store-wide vote;
``feedback``: error-feedback streams; ``frontier``: the layout marker, the live round, the latest commit and
collection. Nothing here is public API: `ObjectStoreAllReduce` runs the phases in order.
"""
