"""The run's global state snapshots, written incrementally: a manifest per checkpointed round, content-named parts.

After a round commits, `MockManager` checkpoints the global state (every registered torchft state plus its own
``{"round", "step", "batches_committed"}`` under ``"torchft"``). The state is cut into parts
(`crf_diloco.checkpoint.split_state`: its top-level entries with tensors, e.g. one per Streaming DiLoCo fragment)
stored once each under ``state/parts/{digest}.safetensors``, the digest being a MAC of the part's content with the
run's secret, and a small manifest ``state/r{round}.safetensors`` that holds the entries without tensors and refers
to the parts by digest. A part that did not change since an earlier checkpoint (a fragment that did not sync) is
not written again, so a checkpoint after one fragment's sync costs about 1/F of the state, not all of it.

Every object is sealed with the run's secret (`crf_diloco.checkpoint`); a reader loads a state only if its manifest
and every part authenticate and each part is the content its name says. A part is deleted only with the last kept
manifest that refers to it.
"""

from __future__ import annotations

import builtins
import copy
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from crf_diloco._checks import is_int
from crf_diloco.auth import Authenticator
from crf_diloco.checkpoint import (
    Packed,
    PartRef,
    loads_state,
    pack_state,
    part_digest,
    referenced_parts,
    seal_packed,
    split_state,
    unpack_state,
)
from crf_diloco.errors import CorruptObjectError
from crf_diloco.layout import parse_state_key, part_key, state_key
from crf_diloco.store import ObjectStore
from crf_diloco.wire import HEADER_PROBE, READ_CHUNK, READ_MIN, Header, RunAll, read_header, read_objects, run_all

__all__ = ["KEEP_STATES", "WRITE_BUDGET", "WRITE_LANES", "FrozenState", "StateSnapshots"]

#: authentic states kept in the store (older ones are deleted when a new one is written)
KEEP_STATES = 3
#: the most parts `StateSnapshots.put` uploads at once: enough connections to fill a link that caps each one, and
#: at most half of `crf_diloco.rounds.peer.READERS` borrowed, so a round's reads beside an upload find threads
WRITE_LANES = 8
#: the most part bytes `StateSnapshots.put` uploads at once (each upload holds a copy of its part): parts larger than
#: half of it go one at a time, as s3fs splits a part of 100 MB or more into chunks it sends at once anyway
WRITE_BUDGET = 256 << 20


@dataclass(frozen=True)
class FrozenState:
    """A state copied for a checkpoint (`StateSnapshots.freeze`): its top-level keys in order, the entries without
    tensors, and the others packed into parts."""

    order: tuple[str, ...]
    inline: dict[str, Any]
    parts: tuple[Packed, ...]


class StateSnapshots:
    """The global states written after committed rounds, under ``state/`` of a run's prefix.

    Args:
        store: the run's prefix.
        auth: MACs keyed with the run's secret (a state that fails them is corrupt, never loaded).
        keep: authentic states to keep (the newest ``keep`` up to the one just written).
        run: runs requests at once (`crf_diloco.rounds.peer.Peer.concurrently`); ``None``: one after the other. A
            state's parts are then read together (`crf_diloco.wire.read_objects`) and uploaded together: over a
            network a heal costs about three round trips and the parts' bytes over several connections, not a round
            trip per part, and a checkpoint about one part's upload time when the link is not full.
        read_chunk: the most bytes one ranged read of a part asks for.
        write_budget: the most part bytes uploaded at once (the memory a checkpoint's uploads hold beside the state;
            at least one part at a time whatever its size).
    """

    def __init__(
        self,
        store: ObjectStore,
        auth: Authenticator,
        *,
        keep: int = KEEP_STATES,
        run: RunAll | None = None,
        read_chunk: int = READ_CHUNK,
        write_budget: int = WRITE_BUDGET,
    ) -> None:
        if not is_int(keep) or keep < 1:
            raise ValueError(f"keep must be an int >= 1 (states kept in the store), got {keep!r}")
        if not is_int(read_chunk) or read_chunk < 1:
            raise ValueError(f"read_chunk must be an int >= 1 (bytes per ranged read), got {read_chunk!r}")
        if not is_int(write_budget) or write_budget < 1:
            raise ValueError(f"write_budget must be an int >= 1 (part bytes uploaded at once), got {write_budget!r}")
        self._store = store
        self._auth = auth
        self.keep = keep
        self._run = run
        self._chunk = read_chunk
        self._budget = write_budget
        self._counted = threading.Lock()
        self._written = 0
        self._read = 0

    @property
    def bytes(self) -> tuple[int, int]:
        """(written, read): bytes of the manifests and parts this instance created and of those it read (healing),
        so a job can tell its checkpoints' share of the store's traffic from its rounds'."""
        with self._counted:
            return self._written, self._read

    def _count(self, written: int = 0, read: int = 0) -> None:
        with self._counted:
            self._written += written
            self._read += read

    def write(self, round_id: int, state: dict[str, Any]) -> bool:
        """Create the state of committed round ``round_id`` (create-only: False if its manifest is there already),
        then collect older ones."""
        return self.put(round_id, self.freeze(state))

    def freeze(self, state: dict[str, Any]) -> FrozenState:
        """``state`` cut into parts and copied now (no I/O, no hashing), so it may change once this returns (e.g.
        while `put` uploads it in the background)."""
        inline, parts = split_state(state)
        return FrozenState(tuple(state), copy.deepcopy(inline), tuple(parts))  # inline: no tensors

    def put(self, round_id: int, frozen: FrozenState) -> bool:
        """Name the parts of a `freeze` d state while listing those the store has, upload the others (with ``run`` at
        once, on at most `WRITE_LANES` connections and ``write_budget`` bytes), then create its manifest (False if one
        is there already) and collect older states. Over a network a first checkpoint of F parts costs one part's
        round trips, not F."""
        naming: list[Callable[[], Any]] = [
            lambda: [part_digest(p, self._auth) for p in frozen.parts],
            partial(self._store.list_names, "state/parts"),
        ]
        digests, names = run_all(naming, self._run)  # the listing on one borrowed thread, the naming on this one
        stored = set(names)
        refs = {entry: PartRef(d) for d, part in zip(digests, frozen.parts, strict=True) for entry in part.entries}
        missing = [
            (d, p) for d, p in zip(digests, frozen.parts, strict=True) if part_key(d).rsplit("/", 1)[-1] not in stored
        ]
        largest = max([1, *(part.nbytes for _, part in missing)])
        width = min(len(missing), max(1, min(WRITE_LANES, self._budget // largest)))
        lanes = [missing[i::width] for i in range(width)]
        run_all([partial(self._put_parts, lane) for lane in lanes], self._run)
        manifest = pack_state({k: refs[k] if k in refs else frozen.inline[k] for k in frozen.order})
        sealed = seal_packed(manifest, state_key(round_id), self._auth)
        created = self._store.put_create(state_key(round_id), sealed)
        if created:
            self._count(written=sum(b.nbytes for b in sealed))
        self.collect(round_id)
        return created

    def _put_parts(self, parts: list[tuple[str, Packed]]) -> None:
        """Create each part under its digest's key, one after the other (one lane of `put`)."""
        for digest, part in parts:
            key = part_key(digest)
            sealed = seal_packed(part, key, self._auth)
            if self._store.put_create(key, sealed):
                self._count(written=sum(b.nbytes for b in sealed))

    def exists(self, round_id: int) -> bool:
        """Whether something is stored under the manifest key of ``round_id`` (authentic or not)."""
        return self._store.exists(state_key(round_id))

    def read(self, round_id: int, have: Callable[[], Mapping[str, Packed]] | None = None) -> dict[str, Any] | None:
        """The authentic state of ``round_id`` (``None`` if it has no manifest); `CorruptObjectError` if the manifest
        or a part is not authentic, malformed, missing, or not the content its name says.

        Three waves of requests: the manifest, every part's header (over a network with its first MiB,
        `crf_diloco.wire.READ_MIN`, or ``read_chunk`` bytes without ``run``: all of a small part), then the rest of
        every part in ranged reads at once; the parts are then verified at once too (hashing releases the GIL).
        ``have``: on a remote store, the reader's own parts by digest (`local_parts`, called only if the manifest
        names parts); a part found there is not read (a digest is a MAC of the content with the run's secret, so
        equal digests are equal parts)."""
        key = state_key(round_id)
        blob = self._store.try_get(key)
        if blob is None:
            return None
        self._count(read=len(blob))
        state = loads_state(blob, key, self._auth)
        refs = {name: value.digest for name, value in state.items() if isinstance(value, PartRef)}
        digests = list(dict.fromkeys(refs.values()))
        own = have() if have is not None and digests and self._store.remote else {}
        fetch = [d for d in digests if d not in own]
        first = self._chunk if self._run is None else min(self._chunk, READ_MIN)  # spread over several reads
        probe = max(HEADER_PROBE, first) if self._store.remote else HEADER_PROBE
        headers = run_all([partial(self._part_header, key, d, probe) for d in fetch], self._run)
        blobs = read_objects(self._store, headers, self._run, self._chunk)
        checked = run_all([partial(self._check_part, d, b) for d, b in zip(fetch, blobs, strict=True)], self._run)
        loaded = dict(zip(fetch, checked, strict=True))
        loaded.update((d, unpack_state(own[d])) for d in digests if d in own)
        for name, digest in refs.items():
            if name not in loaded[digest]:
                raise CorruptObjectError(f"{key}: part {digest} has no entry {name!r}")
            state[name] = loaded[digest][name]
        return state

    def local_parts(self, state: dict[str, Any]) -> dict[str, Packed]:
        """A replica's own ``state`` (its registered states, as a writer checkpoints them) cut into parts and copied,
        by digest: what `read` need not fetch. Hashes every byte of ``state`` (cheaper than a network's transfer)."""
        return {part_digest(part, self._auth): part for part in split_state(state)[1]}

    def _part_header(self, manifest: str, digest: str, probe: int) -> Header:
        key = part_key(digest)
        try:
            return read_header(self._store, key, self._auth, probe)
        except FileNotFoundError:
            raise CorruptObjectError(f"{manifest}: its part {key} is missing (collected or never written)") from None

    def _check_part(self, digest: str, blob: builtins.bytes) -> dict[str, Any]:  # `bytes` is a property here
        key = part_key(digest)
        self._count(read=len(blob))
        part = loads_state(blob, key, self._auth)
        if part_digest(pack_state(part, copy=False), self._auth) != digest or any(
            isinstance(v, PartRef) for v in part.values()
        ):
            raise CorruptObjectError(f"{key}: its content is not the part its name says")
        return part

    def listed(self) -> list[int]:
        """The rounds of the objects named like manifests (by name only: not authenticated), ascending."""
        return sorted(r for r in map(parse_state_key, self._store.list_names("state")) if r is not None)

    def _refs(self, round_id: int) -> set[str] | None:
        """The digests an authentic manifest refers to (read from its header), or ``None`` if it is not one."""
        try:
            return referenced_parts(read_header(self._store, state_key(round_id), self._auth))
        except (FileNotFoundError, CorruptObjectError):
            return None

    def collect(self, round_id: int) -> None:
        """Keep the ``keep`` newest authentic states up to ``round_id`` and delete the authentic ones before them,
        with the parts no remaining authentic manifest refers to. Only manifests whose header authenticates are
        counted or deleted, none after ``round_id``: junk named like a state (``state/r99999999.safetensors``) is
        neither kept in place of a real checkpoint nor deleted. Manifests after ``round_id`` are not read: a part they
        share with a dropped manifest did not change in between, so ``round_id``'s manifest names it too."""
        kept = 0
        dropped: set[str] = set()
        remaining: set[str] = set()
        manifests: list[str] = []
        rounds = sorted((r for r in self.listed() if r <= round_id), reverse=True)
        if len(rounds) <= self.keep:
            return  # no more than `keep` authentic ones among them: none to drop, no header to read
        for r, refs in zip(rounds, run_all([partial(self._refs, r) for r in rounds], self._run), strict=True):
            if refs is None:
                continue
            kept += 1
            if kept > self.keep:
                manifests.append(state_key(r))
                dropped |= refs
            else:
                remaining |= refs
        self._delete(manifests)  # before their parts: a state is either whole or gone
        self._delete([part_key(d) for d in sorted(dropped - remaining)])

    def _delete(self, keys: list[str]) -> None:
        """Best-effort delete of ``keys``: in one bulk request per 1000 on a remote store, else one by one."""
        if self._store.remote:
            self._store.remove_keys(keys)
        else:
            for key in keys:
                self._store.remove(key)
