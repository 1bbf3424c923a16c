"""ettflow.flows"""
