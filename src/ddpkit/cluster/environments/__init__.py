"""Launcher environments, one small module each (the variable readers they share are in
:mod:`ddpkit.cluster.envvars`); :mod:`ddpkit.cluster.detect` holds their detection order.
"""
