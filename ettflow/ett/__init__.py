"""ettflow.ett"""
