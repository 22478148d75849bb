"""The job: set-up, the controller and the loop that drives rollout and training."""
