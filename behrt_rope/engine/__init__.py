"""Where the data stages run: in this process (``engine=local``) or on a Ray cluster (``engine=ray``).

Ray is an optional extra (``pip install behrt-rope[ray]``) and is imported only when ``engine=ray``.
"""
