"""ettflow.trainer"""
