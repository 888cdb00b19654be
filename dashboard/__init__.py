"""The terminal dashboard: the cluster, live, token by token (`edgetp dashboard`).

Nothing happens at import time; `dashboard.app.run(url)` starts it.
"""
