"""The serving result cache: Energon-AI's ``cache_size`` / ``cache_list_size`` LRU list cache.

Up to ``cache_size`` keys (a prompt with its generation settings) are kept, least recently used
evicted first. Each key holds up to ``cache_list_size`` results: until the list is full a request
is generated and its result appended; once full, a random stored result is returned without
generating (several results per key keep sampled answers varied). ``cache_size=0`` disables it.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["ResultCache"]

T = TypeVar("T")


class ResultCache(Generic[T]):
    """A thread-safe LRU cache of result lists.

    Example:
        >>> cache: ResultCache[str] = ResultCache(cache_size=2, cache_list_size=1)
        >>> cache.get("a") is None
        True
        >>> cache.add("a", "x"); cache.get("a")
        'x'
    """

    def __init__(self, cache_size: int, cache_list_size: int, seed: int | None = None) -> None:
        if cache_size < 0 or cache_list_size < 1:
            raise ValueError(
                f"ResultCache(cache_size={cache_size}, cache_list_size={cache_list_size}): "
                "cache_size must be >= 0 (0 disables) and cache_list_size >= 1."
            )
        self.cache_size = cache_size
        self.cache_list_size = cache_list_size
        self._entries: OrderedDict[Hashable, list[T]] = OrderedDict()
        self._lock = threading.Lock()
        self._random = random.Random(seed)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> T | None:
        """A random stored result once ``key``'s list is full, else ``None`` (generate it)."""
        with self._lock:
            results = self._entries.get(key)
            if results is None:
                return None
            self._entries.move_to_end(key)
            if len(results) < self.cache_list_size:
                return None
            return self._random.choice(results)

    def add(self, key: Hashable, result: T) -> None:
        """Store ``result`` under ``key`` (dropped when the list is full), evicting the LRU key."""
        if self.cache_size == 0:
            return
        with self._lock:
            results = self._entries.setdefault(key, [])
            self._entries.move_to_end(key)
            if len(results) < self.cache_list_size:
                results.append(result)
            while len(self._entries) > self.cache_size:
                self._entries.popitem(last=False)
