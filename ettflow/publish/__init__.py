"""ettflow.publish"""
