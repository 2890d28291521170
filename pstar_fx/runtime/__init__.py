"""The runtime: what runs a scheduled graph, and nothing of how it was planned (it imports only the IR).

run.py runs one compiled step; executor.py walks the graph; step_runtime.py is the state the inserted operations
act on; chunk_store.py keeps the chunk buffers, their residency and the copies between host and device, with the
device pool (device_pool.py), host memory (host_memory.py), host-side updates (host_updates.py) and values by name
(store_values.py); adam.py updates whole chunks; comm.py is the process group.
"""
