"""Worker pools: the Celery app, the tasks that feed one engine per worker process, and the KV hand-off.

``app`` is torch-free (the gateway uses ``make_app`` to send tasks); everything else runs on workers.
Start a worker with ``run_worker`` (from ``gpu_workers.pools.worker``) or ``python -m gpu_workers.pools.worker``.
"""
