"""Slow, obviously-right references for the simulator's policies (plain Python, lists and dicts).

Each function takes a trace (a sequence of ints) and a capacity in objects and returns
the list of hit flags (bools), one per request.  They follow the same definitions as the
Numba kernels of :mod:`tiered_emb.sim.policies` (libCacheSim's), written the way a
textbook would: lists ordered oldest first, linear scans, no cleverness.  LRU and LFU
are the store's: one oracle, :class:`tiered_emb.testing.reference.ReferencePolicy`, run
one request a batch, so the simulator's twins and the store's kernels answer to the same.
"""

from __future__ import annotations

from tiered_emb.testing.reference import ReferencePolicy


def _one_request_at_a_time(policy, trace, capacity):
    """Hit flags of the store's reference policy with each request a batch of its own."""
    ref = ReferencePolicy(capacity, policy)
    return [ref.access([x])[0][0] for x in trace]


def lru(trace, capacity):
    """The store's LRU (:class:`~tiered_emb.testing.reference.ReferencePolicy`), one request a batch."""
    return _one_request_at_a_time("lru", trace, capacity)


def lfu(trace, capacity):
    """The store's LFU: fewest uses since admission, then least recent use, then lowest slot;
    counts die with eviction (:class:`~tiered_emb.testing.reference.ReferencePolicy`)."""
    return _one_request_at_a_time("lfu", trace, capacity)


def fifo(trace, capacity):
    queue, out = [], []
    for x in trace:
        hit = x in queue
        out.append(hit)
        if not hit:
            if len(queue) == capacity:
                queue.pop(0)
            queue.append(x)
    return out


def clock(trace, capacity):
    """FIFO with one reference bit: a set bit sends the oldest back to the newest end."""
    queue, ref, out = [], {}, []
    for x in trace:
        hit = x in ref
        out.append(hit)
        if hit:
            ref[x] = True
            continue
        if len(queue) == capacity:
            while ref[queue[0]]:
                y = queue.pop(0)
                ref[y] = False
                queue.append(y)
            del ref[queue.pop(0)]
        queue.append(x)
        ref[x] = False
    return out


def sieve(trace, capacity):
    """Insertion order list; the hand moves from old to new over visited objects."""
    queue, visited, out = [], {}, []  # oldest first
    hand = None  # the object the hand points at, None = oldest
    for x in trace:
        hit = x in visited
        out.append(hit)
        if hit:
            visited[x] = True
            continue
        if len(queue) == capacity:
            i = 0 if hand is None else queue.index(hand)
            while visited[queue[i]]:
                visited[queue[i]] = False
                i = (i + 1) % len(queue)
            victim = queue.pop(i)
            hand = queue[i] if i < len(queue) else None
            del visited[victim]
        queue.append(x)
        visited[x] = False
    return out


def s3fifo(trace, capacity, small_ratio=0.1, ghost_ratio=0.9, threshold=2):
    """S3-FIFO as libCacheSim 0.3 (``S3FIFO.c``): small, main (2-bit clock), ghost ids."""
    small_cap = max(int(capacity * small_ratio), 1) if capacity > 1 else 0
    main_cap = capacity - small_cap
    ghost_cap = int(capacity * ghost_ratio)
    small, main, ghost, freq, out = [], [], [], {}, []
    has_evicted = False
    for x in trace:
        hit = x in freq
        out.append(hit)
        if hit:
            freq[x] += 1
            continue
        in_ghost = x in ghost
        if in_ghost:
            ghost.remove(x)
        while len(small) + len(main) >= capacity:
            has_evicted = True
            if len(main) > main_cap or not small:
                y = main.pop(0)
                if freq[y] >= 1:
                    freq[y] = min(freq[y], 3) - 1
                    main.append(y)
                else:
                    del freq[y]
            else:
                while small:  # until one leaves the cache (or small is empty)
                    y = small.pop(0)
                    if freq[y] >= threshold:
                        freq[y] = 0
                        main.append(y)
                        continue
                    del freq[y]
                    if ghost_cap > 0:
                        if len(ghost) == ghost_cap:
                            ghost.pop(0)
                        ghost.append(y)
                    break
        if in_ghost or (not has_evicted and len(small) >= small_cap):
            main.append(x)
        else:
            small.append(x)
        freq[x] = 0
    return out


def arc(trace, capacity):
    """ARC (Megiddo and Modha, 2003) with a float target ``p``, as libCacheSim's ``ARC.c``.
    Lists are most recent first."""
    t1, t2, b1, b2, out = [], [], [], [], []
    p = 0.0

    def replace(in_b2):
        if (t1 and (len(t1) > p or (len(t1) == p and in_b2))) or not t2:
            b1.insert(0, t1.pop())
        else:
            b2.insert(0, t2.pop())

    for x in trace:
        if x in t1 or x in t2:
            out.append(True)
            (t1 if x in t1 else t2).remove(x)
            t2.insert(0, x)
            continue
        out.append(False)
        ghost = x in b1 or x in b2
        in_b2 = x in b2
        if x in b1:
            p = min(p + max(len(b2) / len(b1), 1.0), float(capacity))
            b1.remove(x)
        elif in_b2:
            p = max(p - max(len(b1) / len(b2), 1.0), 0.0)
            b2.remove(x)
        while len(t1) + len(t2) >= capacity:
            if ghost:
                replace(in_b2)
            elif len(t1) + len(b1) >= capacity:
                if b1:
                    b1.pop()
                    replace(in_b2)
                else:
                    t1.pop()
            else:
                if len(t1) + len(t2) + len(b1) + len(b2) >= 2 * capacity and b2:
                    b2.pop()
                replace(in_b2)
        (t2 if ghost else t1).insert(0, x)
    return out


def belady(trace, capacity):
    """Evict the resident whose next request is farthest (never = infinitely far)."""
    trace = list(trace)
    cache, out = set(), []
    for i, x in enumerate(trace):
        hit = x in cache
        out.append(hit)
        if hit:
            continue
        if len(cache) == capacity:

            def next_use(y, i=i):
                for j in range(i + 1, len(trace)):
                    if trace[j] == y:
                        return j
                return float("inf")

            cache.remove(max(cache, key=next_use))
        cache.add(x)
    return out


REFERENCES = {
    "lru": lru,
    "lfu": lfu,
    "fifo": fifo,
    "clock": clock,
    "sieve": sieve,
    "s3fifo": s3fifo,
    "arc": arc,
    "belady": belady,
}


def stack_distance_hits(trace, capacity):
    """LRU hits by the stack property: a request hits iff fewer than ``capacity`` distinct
    ids were used since its id's previous request."""
    hits = 0
    for i, x in enumerate(trace):
        prev = [j for j in range(i) if trace[j] == x]
        if prev and len(set(trace[prev[-1] + 1 : i])) < capacity:
            hits += 1
    return hits
