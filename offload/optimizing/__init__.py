"""What ``OffloadOptimizer`` (``offload/optimizer.py``) hands off, one job a file: which inner
optimizer steps which parameters (``plan.py``) and those the model replaced since it was built
(``let_go.py``), ``step()`` run eagerly under ``torch.compile`` (``eager_step.py``), the hand-off of each slice's update to the host
worker (``stepping.py``) and what it remembers of one that failed part way
(``partial_failure.py``), the sharded update's exchange across ranks (``sharding.py``), and its
side of the disk tier: stepping, saving and loading the state kept in files
(``tier_plumbing.py``); how it is deep-copied and pickled (``copying.py``); and the checks of its
arguments (``arguments.py``). Nothing here is
public: users reach it through ``OffloadOptimizer``."""
