"""zerokv's private core: reading arguments into facts, checks, plans, kernel descriptions,
launching, the CPU path and the caches. Nothing here is public API."""
