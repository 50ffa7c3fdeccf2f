"""Worker pools: the tasks that feed one engine per worker process, heartbeats, and the KV hand-off.

Start a worker with ``run_worker`` (from ``gpu_workers.pools.worker``) or ``python -m gpu_workers.pools.worker``.
The Celery app both sides share is ``gpu_workers.protocol.make_celery``.
"""
