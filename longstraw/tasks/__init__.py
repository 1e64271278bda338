"""The Prefect task layer: one thin task per stage of the step (`stages`), their retry and cache
policies (`policies`), and the lock manager behind the prefill shards' cache (`locks`).

A task reads refs, calls its stage (`longstraw.training.stages`) and returns refs; it does no
math. The flows (`longstraw.flows`) compose them.
"""
