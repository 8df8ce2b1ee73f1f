"""The planner: predicts the memory, communication and time of a training layout
on a cluster profile, and searches layouts."""
