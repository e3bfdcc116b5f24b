"""draftsmith.distill"""
