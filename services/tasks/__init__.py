"""Tasks: prompt/answer generators and checkers shared by data scripts, scorers and evaluation."""
