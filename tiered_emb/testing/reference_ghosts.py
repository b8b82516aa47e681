"""Reference S3-FIFO and ARC with pins, in plain Python: the decisions of the store's
:mod:`tiered_emb.cache.policies.s3fifo` and :mod:`tiered_emb.cache.policies.arc`, written
over lists of ids (oldest first) so that each rule reads as one line.

:class:`tiered_emb.testing.reference.ReferencePolicy` delegates to these for the two
policies; each object answers ``use(id)``, ``admit(id)``, ``victim(pinned)`` (the evicted
id, ``None`` when every id is pinned) and ``insert(id)``, in that protocol.
"""

from __future__ import annotations

from tiered_emb.cache.policies import s3fifo_sizes


class ReferenceS3FIFO:
    """Small and main FIFO queues, a count (at most 3) per id, a ghost queue of ids."""

    def __init__(self, capacity: int):
        self.small_cap, self.main_cap, self.ghost_cap = s3fifo_sizes(capacity)
        self.small: list[int] = []
        self.main: list[int] = []
        self.ghost: list[int] = []
        self.freq: dict[int, int] = {}
        self.evicted = False
        self.ghost_hit = False

    def use(self, i: int) -> None:
        self.freq[i] = min(self.freq[i] + 1, 3)

    def admit(self, i: int) -> None:
        self.ghost_hit = i in self.ghost
        if self.ghost_hit:
            self.ghost.remove(i)

    def _from_main(self, pinned: set[int]) -> int | None:
        """Main's oldest with no use left; a used one loses a use and goes round; pinned ones go round as they are."""
        for _ in range(4 * len(self.main) + 1):
            if not self.main:
                return None
            v = self.main.pop(0)
            if v not in pinned and self.freq[v] == 0:
                return v
            if v not in pinned:
                self.freq[v] -= 1
            self.main.append(v)
        return None

    def _from_small(self, pinned: set[int]) -> int | None:
        """Small's oldest: used twice or more moves to main, otherwise evicted and ghosted."""
        passed = 0
        while len(self.small) > passed:
            v = self.small.pop(0)
            if v in pinned:
                self.small.append(v)
                passed += 1
            elif self.freq[v] >= 2:
                self.freq[v] = 0
                self.main.append(v)
                if not self.small:
                    return self._from_main(pinned)
            else:
                if self.ghost_cap > 0:
                    if len(self.ghost) == self.ghost_cap:
                        self.ghost.pop(0)
                    self.ghost.append(v)
                return v
        return None

    def victim(self, pinned: set[int]) -> int | None:
        self.evicted = True
        if len(self.main) > self.main_cap or not self.small:
            v = self._from_main(pinned)
            return v if v is not None else self._from_small(pinned)
        v = self._from_small(pinned)
        return v if v is not None else self._from_main(pinned)

    def insert(self, i: int) -> None:
        to_main = self.ghost_hit or (not self.evicted and len(self.small) >= self.small_cap)
        (self.main if to_main else self.small).append(i)
        self.freq[i] = 0
        self.ghost_hit = False

    def forget(self, i: int) -> None:
        del self.freq[i]


class ReferenceARC:
    """T1 (seen once) and T2 (seen again), their ghosts B1 and B2, T1's target ``p``."""

    def __init__(self, capacity: int):
        self.c = capacity
        self.t1: list[int] = []
        self.t2: list[int] = []
        self.b1: list[int] = []
        self.b2: list[int] = []
        self.p = 0.0
        self.ghost_hit = self.in_b2 = False

    def use(self, i: int) -> None:
        (self.t1 if i in self.t1 else self.t2).remove(i)
        self.t2.append(i)

    def admit(self, i: int) -> None:
        self.ghost_hit = i in self.b1 or i in self.b2
        self.in_b2 = i in self.b2
        if i in self.b1:
            self.p = min(self.p + max(len(self.b2) / len(self.b1), 1.0), float(self.c))
            self.b1.remove(i)
        elif i in self.b2:
            self.p = max(self.p - max(len(self.b1) / len(self.b2), 1.0), 0.0)
            self.b2.remove(i)

    def _ghost(self, ghosts: list[int], v: int) -> None:
        """``v`` the newest of ``ghosts``; the pool holds capacity + 2 ghosts, B1's oldest forgotten first."""
        if len(self.b1) + len(self.b2) == self.c + 2:
            (self.b1 if self.b1 else self.b2).pop(0)
        ghosts.append(v)

    def _oldest(self, lst: list[int], ghosts: list[int] | None, pinned: set[int]) -> int | None:
        for _ in range(len(lst)):
            v = lst.pop(0)
            if v in pinned:
                lst.append(v)
                continue
            if ghosts is not None:
                self._ghost(ghosts, v)
            return v
        return None

    def _either(self, first, second, pinned):
        v = self._oldest(*first, pinned)
        return v if v is not None else self._oldest(*second, pinned)

    def victim(self, pinned: set[int]) -> int | None:
        n1, n2, nb1, nb2 = len(self.t1), len(self.t2), len(self.b1), len(self.b2)
        if not self.ghost_hit:
            if n1 + nb1 + 1 > self.c:
                if nb1:
                    self.b1.pop(0)
                else:
                    return self._either((self.t1, None), (self.t2, self.b2), pinned)
            elif n1 + n2 + nb1 + nb2 >= 2 * self.c and nb2:
                self.b2.pop(0)
        if (n1 > 0 and (n1 > self.p or (n1 == self.p and self.in_b2))) or n2 == 0:
            return self._either((self.t1, self.b1), (self.t2, self.b2), pinned)
        return self._either((self.t2, self.b2), (self.t1, self.b1), pinned)

    def insert(self, i: int) -> None:
        (self.t2 if self.ghost_hit else self.t1).append(i)
        self.ghost_hit = self.in_b2 = False

    def forget(self, i: int) -> None:
        pass


#: The reference of each ghost policy, by name.
GHOST_POLICIES = {"s3fifo": ReferenceS3FIFO, "arc": ReferenceARC}
