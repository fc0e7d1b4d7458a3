"""Small attention programs the detection tests run through both front ends."""
