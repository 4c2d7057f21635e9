"""The runtime: executes the simulator's layout with torch.distributed and measures it.

model.py (the network), objective.py (BD3-LM and plain autoregressive), attention.py (LSE attention and its exchanges),
comm.py (every collective, counted), plans/ (what each rank does), train.py (the loop, torchrun
entry), launch.py (`csbp run`); the plan file they read is `simulator/planner/planfile.py`.
"""
