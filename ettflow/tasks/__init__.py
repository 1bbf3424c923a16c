"""ettflow.tasks"""
