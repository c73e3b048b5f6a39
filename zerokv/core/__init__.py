"""zerokv's private core: the ops' specs, their validation and bound calls, the executors, plans,
kernel descriptions, launching, the CPU path and the caches. Nothing here is public API."""
