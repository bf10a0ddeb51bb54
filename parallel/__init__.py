"""Parallel strategies, one file each, applied to model.py's GPT from outside (model.py imports nothing from here).

parallel=single (conf/parallel/single.yaml) is plain single-process training: the reference that every strategy is
checked against, numerically, in tests/.
"""
